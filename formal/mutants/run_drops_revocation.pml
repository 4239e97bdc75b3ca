/*
 * Mutant: decode drops a revocation of a Run that has its notice but has not joined the batch yet
 * Guard removed: decode records a write-done notice against its Run in the stream handler, before it
 *   handles the next message, so a revocation after the notice ends that Run at any stage.
 * Counter-example: r0's notice is logged, r0 is revoked; both arrive in order, but the revocation
 *   finds r0 still verifying (not in the scheduler) and is dropped; r0 reads; lock_delay passes, the
 *   page is swept (the revocation arrived: no blind stop), granted to r1 and written while r0 still
 *   reads it (P2, or P1).
 * Both requests use Decode.Run (-DRUNPATH=3, the configuration of model-both-run).
 */
#define RUNPATH 3
#define MUT_RUN_DROPS_REVOCATION
#include "../pdserve.pml"
