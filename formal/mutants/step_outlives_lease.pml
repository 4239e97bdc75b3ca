/*
 * Mutant: a revoked reader's page leaves quarantine lock_delay after the revocation, with no
 *   acknowledgement from decode (the rule before issue 18)
 * Guard removed: with a decode step that checks its tags, then writes its own KV into its page later
 *   (-DSTEP_WRITES: a stalled step thread while decode's event loop keeps renewing), the broker frees
 *   a revoked reader's pages only after decode's KeepAlive no longer lists the owner (decode lists
 *   every owner of its step in flight), or once the pool's reader expired (issue 18, hole 2).
 * Counter-example: r0's step passes its check and stalls; r0 is revoked (an operator Revoke, or
 *   reconciliation); lock_delay passes: decode has stopped the request (the notice, or the blind stop)
 *   but the step thread still runs, and the page is FREE while that step can still write it (P4);
 *   granted to r1 and written, r1 would read r0's late write (P1).
 * -DSTEP_WRITES, the configuration of model-step-writes.
 */
#define STEP_WRITES
#define MUT_NO_STEP_ACK
#include "../pdserve.pml"
