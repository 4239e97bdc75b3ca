/*
 * Mutant: revoking a reader of a cached page ends its share at once (issue 20, prefix reuse)
 * Guard removed: a revoked reader's share keeps the page unevictable until lock_delay after the revocation (or
 *   decode's acknowledgement), as a revoked lease's page stays quarantined: the reader may step until the
 *   notice reaches it, and the blind stop ends it by then.
 * Counter-example: r1 publishes its page and reads it; the broker revokes r1, the notice is delayed; the page,
 *   unread now, is evicted: FREE while r1, not told yet, still reads it (P2); the next Grant takes and writes
 *   it (P1 when its data lands before its tag and r1 steps).
 * -DPREFIX, both requests on the old path, no hostile call of the default runs, r1 of the other scope.
 */
#define PREFIX
#define RUNPATH 0
#define NO_HOSTILE
#define R1ID 1
#define MUT_REVOKE_FREES_SHARED
#include "../pdserve.pml"
