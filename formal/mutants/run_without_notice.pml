/*
 * Mutant: a Run reads on prefill's own answer (relayed by the gateway), without the write-done notice
 * Guard removed: Decode.Run waits for the broker's write-done notice of its leases, which the broker
 *   logs only if the leases are current at EndWrite; it then reads with no Validate.
 * Counter-example: the old no_validate, via Run: the lease is revoked while prefill writes; its
 *   EndWrite frees the page; prefill answers done; the Run verifies its own complete bytes and reads
 *   while the page is granted to the other request and written (P1, or P2).
 * Both requests use Decode.Run (-DRUNPATH=3, the configuration of model-both-run).
 */
#define RUNPATH 3
#define MUT_RUN_NO_NOTICE
#include "../pdserve.pml"
