/*
 * Mutant: the prefix scope ignores the tenant and cache_salt (issue 20, prefix reuse)
 * Guard removed: scope_key(tenant, cache_salt, scope) seeds the chain (chain_seed) and the broker's scope tag
 *   (scope_tag); here both lose the tenant and the salt, as a gateway that sends the same scope for every
 *   caller would.
 * Counter-example, in honest operation: r1 (scope B) writes, verifies and publishes its page; r0 (scope A,
 *   the same tokens) computes the same chain key and scope tag, its Grant shares r1's cached page, every check
 *   of the page passes (the tag, its chain words, the published checksum) and r0's step reads KV of another
 *   tenant's (scope, position, tokens) (P1).
 * -DPREFIX, r1 of the other scope, no fault.
 */
#define PREFIX
#define R1ID 1
#define FAULTS 0
#define MUT_SALT_IGNORED
#include "../pdserve.pml"
