/*
 * Mutant: a revoked adopted lease leaves quarantine without the blind stop
 * Guard removed: the new leader may revoke a lease it adopted at a failover; its page then waits for the old
 *   term's writes (the adopted mark) and for the revocation's rule (lock_delay after it, by which time decode
 *   has either received the notice or heard nothing for longer than its blind bound and stopped every request).
 * Counter-example: the new leader revokes an adopted lease whose reader still reads; the notice is delayed, the
 *   page leaves quarantine once the old term drained and is granted to another request, while the first reader,
 *   not stopped, still reads it (P2).
 */
#define FAILOVER
#define MUT_FO_ADOPTED_REVOKE_UNBLIND
#define FAULTS 0          /* revocations alone (the counter-example needs no other fault) */
#define REVOKE_FAULTS 1
#include "../pdserve.pml"
