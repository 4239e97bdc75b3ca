/*
 * Mutant: a leader keeps authorising past its etcd lease
 * Guard removed: a leader answers BeginWrite and writer renewals only until its authority ends, a bound counted
 *   on its own clock from the send of its last successful etcd lease renewal, shorter than the lease's ttl
 *   (A8), so that its authority has ended before etcd can elect another leader.
 * Counter-example: a paused or partitioned old leader goes on accepting a BeginWrite and renewing its writer
 *   after the new leader took over; the new leader's wait for the old term's writes ends while that writer
 *   still posts, and the page it writes is granted again (P4).
 */
#define FAILOVER
#define MUT_FO_AUTH_PAST_LEASE
#include "../pdserve.pml"
