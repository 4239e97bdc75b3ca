/*
 * Mutant: a lease adopted at a failover is not sealed
 * Guard removed: the new leader does not know whether a write began on an adopted generation, so it takes the
 *   generation as written: no BeginWrite may name it again.
 * Counter-example: decode hands over a request it already reads; once the old term drained, a second Prefill of
 *   the same lease (a retry, a replay) is accepted by the new leader and writes another prompt's KV into the
 *   page under the request's own lease, which its next step reads (P1).
 */
#define FAILOVER
#define MUT_FO_ADOPT_UNSEALED
#include "../pdserve.pml"
