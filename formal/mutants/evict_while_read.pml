/*
 * Mutant: eviction takes a cached page that has readers (issue 20, prefix reuse)
 * Guard removed: the broker evicts only unread cached pages (no reader, no revoked reader not yet swept) when
 *   a Grant or an Extend finds the pool short; here any cached page.
 * Counter-example, in honest operation: r0 publishes its page and is still its reader; r1 (other content)
 *   waits for a page; the broker evicts r0's page, FREE at once, and grants it to r1; r1's data lands before
 *   its tag, r0's step check still sees its own tag and reads r1's KV (P1; or P2 once r1 validates).
 * -DPREFIX, r1 of the other scope, no fault.
 */
#define PREFIX
#define R1ID 1
#define FAULTS 0
#define MUT_EVICT_WHILE_READ
#include "../pdserve.pml"
