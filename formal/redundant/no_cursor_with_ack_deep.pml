/*
 * Redundant with decode's acknowledgement of a revocation (expected: errors: 0): mutants/no_cursor.pml
 * under -DSTEP_WRITES. A revocation the stream drops for good leaves decode stepping the owner and
 * listing it in its KeepAlive, so the page stays quarantined until the request ends. Without the
 * acknowledgement (the other runs) the cursor is a guard: the mutant fails.
 * FORMAL_DEEP=1 only (it repeats model-step-writes' argument).
 */
#define STEP_WRITES
#define MUT_NO_CURSOR
#include "../pdserve.pml"
