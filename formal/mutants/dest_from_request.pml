/*
 * Mutant: prefill writes where the request says
 * Guard removed: prefill takes the destination (transfer session, data and tag base) from
 *   the pool as registered with the broker (BeginWriteResponse) and refuses a request whose
 *   addresses disagree (services/prefill/servicer.py).
 * Counter-example: r0's request names r1's page as the data destination, the tag address
 *   stays right; r0's data lands in r1's page after r1 verified it; r1's tags are intact,
 *   so its check before the step passes and it reads r0's KV (P1).
 */
#define MUT_DEST_FROM_REQUEST
#include "../pdserve.pml"
