/*
 * Mutant: at a failover the new leader takes every page nobody claims for free
 * Guard removed: a page decode does not hand over and that is not in the durable free set waits in quarantine
 *   until the old term's writes have drained: the old leader's authority ended, every writer it renewed lapsed
 *   (max writer ttl) and what they posted landed (lock_delay).
 * Counter-example: a request's write runs under the old leader when decode ends the request (or before its
 *   Grant reply reached decode); the new leader does not see the page claimed and grants it to another request
 *   at once, while the old write still lands there (P4).
 */
#define FAILOVER
#define MUT_FO_ADOPT_FREE
#include "../pdserve.pml"
