/*
 * Redundant with decode's acknowledgement of a revocation (expected: errors: 0): mutants/no_blind_stop.pml
 * under -DSTEP_WRITES, where a revoked reader's page leaves quarantine only once decode's KeepAlive no
 * longer lists the owner. A decode that cannot hear its revocation stream keeps listing the owners it
 * steps, so their pages stay quarantined: the blind stop only hastens the acknowledgement. Without the
 * acknowledgement (the other runs, with atomic steps) the blind stop is the guard: the mutant fails.
 * FORMAL_DEEP=1 only (it repeats model-step-writes' argument).
 */
#define STEP_WRITES
#define MUT_NO_BLIND_STOP
#include "../pdserve.pml"
