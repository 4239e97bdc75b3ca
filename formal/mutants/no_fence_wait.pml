/*
 * Mutant: decode grants from a new broker incarnation without the fence wait
 * Guard removed: after moving to a broker with a new epoch (or after its pool was forgotten),
 *   decode registers a new pool incarnation and grants from it only reader_ttl + max_ttl +
 *   lock_delay after its last contact with the old broker (services/decode/watch.py).
 * Counter-example: two brokers run at once (a rolling update, a partition); decode moves to the
 *   new one and its pages become grantable at once, while the old broker, whose reader record
 *   has not expired yet, accepts a BeginWrite of a lease it still holds and renews that writer:
 *   the write lands on a page that is FREE (or re-granted) in the new incarnation (P4).
 */
#define MUT_NO_FENCE_WAIT
#include "../pdserve.pml"
