/*
 * Mutant: prefill's liveness check before posting ignores the term
 * Guard removed: a write's liveness is extended only by answers of the term that began it (a renewal answered
 *   by a newer leader does not extend a write the old leader began), so an old-term write stops posting when
 *   the old term's writers lapse, whatever the new leader renews.
 * Counter-example: prefill's batched KeepAlive reaches the new leader, which renews every holder it is given;
 *   prefill takes the answer for its old-term write too and posts after the new leader's wait for the old term
 *   ended, into a page it has granted again (P4).
 */
#define FAILOVER
#define MUT_FO_LIVENESS_ANY_TERM
#include "../pdserve.pml"
