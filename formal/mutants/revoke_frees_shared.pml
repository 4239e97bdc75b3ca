/*
 * Mutant: revoking a reader of a cached page ends its share at once (issue 20, prefix reuse)
 * Guard removed: a revoked reader's share keeps the page unevictable until lock_delay after the revocation (or
 *   decode's acknowledgement), as a revoked lease's page stays quarantined: the reader may step until the
 *   notice reaches it, and the blind stop ends it by then.
 * Counter-example: r0 publishes its page and steps on; the broker revokes r0, the notice is delayed; the page,
 *   unread now, is evicted for r1's Grant and written; r1's data lands before its tag and r0's step reads it
 *   (P1).
 * -DPREFIX, r1 of the other scope.
 */
#define PREFIX
#define R1ID 1
#define MUT_REVOKE_FREES_SHARED
#include "../pdserve.pml"
