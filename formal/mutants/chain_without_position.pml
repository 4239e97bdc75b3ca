/*
 * Mutant: a chain key from the page's own tokens only (issue 20, prefix reuse)
 * Guard removed: page_chains makes key i a hash over the chain before it (every token up to the page's end),
 *   so a key names the page's position and everything before it; here key i covers the page's tokens alone.
 * Counter-example, in honest operation: r1 publishes its page 1 (tokens T after another page U); r0's page 0
 *   holds the same tokens T, gets the same key in the same scope, shares r1's page and reads KV computed at
 *   another offset after other tokens (P1).
 * -DPREFIX, r1's page at the other offset, no fault.
 */
#define PREFIX
#define R1ID 2
#define FAULTS 0
#define MUT_CHAIN_WITHOUT_POSITION
#include "../pdserve.pml"
