/*
 * Mutant: eviction takes a cached page that has readers (issue 20, prefix reuse)
 * Guard removed: the broker evicts only unread cached pages (no reader, no revoked reader not yet swept) when
 *   a Grant or an Extend finds the pool short; here any cached page.
 * Counter-example, in honest operation: r1 publishes its page and is still its reader; r0 (other content)
 *   waits for a page; the broker evicts r1's page, FREE at once, and grants it to r0; r0 writes and verifies
 *   it while r1 still reads it (P2; or P1 when r0's data lands before its tag and r1 steps).
 * -DPREFIX, r1 of the other scope, no fault.
 */
#define PREFIX
#define R1ID 1
#define FAULTS 0
#define MUT_EVICT_WHILE_READ
#include "../pdserve.pml"
