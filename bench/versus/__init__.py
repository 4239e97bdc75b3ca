"""pdserve side by side with vLLM-CPU under one protocol: `python -m pdserve.bench.versus [--quick]
[--baseline-tree DIR]`.

The parts: protocol.py (the rules, pure: cells, round order, the steady-state window, ratios and their spread,
the loaded flag, the open-loop rate), load.py (the one streaming HTTP client, closed and open loop, with the
CPU sampled through the cell), systems.py (the systems behind one face: pdserve at this checkout or at a baseline
tree, vLLM in its default configuration or on both cores), floors.py (the machine's bandwidth and matmul peak, the
model's bytes per decode step and FLOPs per prefill), report.py (Markdown, JSON, summary) and run.py (the rounds).
"""
