/*
 * Mutant: prefill gives up EndWrite after a bounded number of attempts (the model: one; the code: three)
 * Guard removed: EndWrite is always sent and re-sent until the broker answers.
 * Counter-example: the one EndWrite is lost; with a process-wide writer id the writer's
 *   liveness never lapses while it lives, so the quarantined page is never freed (P5:
 *   invalid end state, and LTL drains in mutant-endwrite_gives_up-ltl). With per-write
 *   liveness leases (the code) the lapse frees it:
 *   redundant/endwrite_gives_up_per_write_deep.pml.
 */
#define MUT_ENDWRITE_GIVEUP
#include "../pdserve.pml"
