/*
 * Redundant guard (expected: errors: 0; issue 20): the chain seed leaves the scope out (two tenants' pages of
 * the same tokens get one chain key), but the broker's scope tag keeps it: a Grant shares a page only within
 * its scope tag, so no counter-example exists (honest operation, every content identity of r1);
 * mutants/salt_ignored.pml loses the scope in both and fails. The scope tag is the second, independent check.
 */
#define PREFIX
#define FAULTS 0
#define MUT_CHAIN_WITHOUT_SALT
#include "../pdserve.pml"
