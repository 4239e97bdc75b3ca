"""The machinery every scenario shares: the stack launcher, workload and statistics, the clients, common paths."""
