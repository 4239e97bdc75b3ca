/*
 * Mutant: decode's re-check accepts a cached page without asking whether the request is still among its readers
 * Guard removed: a shared or published page passes the re-check only while the request is one of its readers
 *   (a revoked or released reader's share has ended); here any page CACHED at that generation passes.
 * Counter-example: r0 publishes its page and reads it; the broker revokes r0 (fault) and the stream reports a gap
 *   that loses the notice; the re-check passes the page, so r0 reads on; r0's share is swept, the unread page is
 *   evicted and granted to r1, r1's data lands before its tag, and r0's step reads r1's KV (P1).
 * -DPREFIX, r1 of another scope, both requests on Run, no hostile call, one fault (the revocation).
 */
#define PREFIX
#define R1ID 1
#define NO_HOSTILE
#define MUT_RECHECK_IGNORES_READERS
#include "../pdserve.pml"
