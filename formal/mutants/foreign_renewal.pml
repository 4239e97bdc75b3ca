/*
 * Mutant: the broker lets any decode renew holders that are not its own
 * Guard removed: no caller renews a holder that is not its own: the revoked-reader, failed-write and
 *   earlier-epoch holders of a pool (revoked/, failed/, earlier-epoch/) belong to no caller, and a
 *   reader KeepAlive names only the caller's own pools (issue 18, hole 4). Here a second decode
 *   instance keeps renewing them, and keeps renewing this decode's old pool at the old broker after
 *   the move (-DFOREIGN, MUT_ROLE_AUTHZ bits 2 and 3).
 * Counter-example: a revoked reader's page (or a failed write's, or every page after a restart) is
 *   never freed: a terminal state with a page quarantined for ever (P5). With the old pool kept
 *   alive, the old broker never fences it: after decode's fence wait it still accepts a BeginWrite
 *   of a lease granted before the move, and that write lands on a page the new incarnation freed
 *   (P4; checked with MUT_ROLE_AUTHZ=8 alone, see formal/README.md).
 * -DSTEP_WRITES (the configuration of model-step-writes) and -DFOREIGN.
 */
#define STEP_WRITES
#define FOREIGN
#define MUT_ROLE_AUTHZ 12
#include "../pdserve.pml"
