/*
 * Mutant: decode's re-check accepts a cached page without asking whether the request is still among its readers
 * Guard removed: a shared or published page passes the re-check only while the request is one of its readers
 *   (a revoked or released reader's share has ended); here any page CACHED at that generation passes.
 * Counter-example: r1 publishes its page and reads it; the broker revokes r1 (fault: its share ends) and the stream
 *   reports a gap that loses the notice; the re-check passes the page, so r1 reads on; r1's revoked share is swept
 *   and the page, unread, is evicted: FREE under a live reader (P2; the next Grant takes and writes it, P1).
 * -DPREFIX, r1 of another scope, no hostile call, one fault (the revocation).
 */
#define PREFIX
#define R1ID 1
#define NO_HOSTILE
#define MUT_RECHECK_IGNORES_READERS
#include "../pdserve.pml"
