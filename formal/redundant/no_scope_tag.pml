/*
 * Redundant guard (expected: errors: 0; issue 20): the broker shares a cached page without comparing scope
 * tags; the chain key, seeded with the scope, differs across scopes anyway, so no counter-example exists
 * (honest operation, every content identity of r1). Each of the two checks covers the other;
 * mutants/salt_ignored.pml removes the scope from both.
 */
#define PREFIX
#define FAULTS 0
#define MUT_NO_SCOPE_TAG
#include "../pdserve.pml"
