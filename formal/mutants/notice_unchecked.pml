/*
 * Mutant: the broker logs a write-done notice on any successful EndWrite
 * Guard removed: LeaseTable.end_write logs the notice only when, in the EndWrite step, every lease is
 *   the owner's current one (epoch included) and this writer's BeginWrite is the one active on it.
 * Counter-example: a Run's lease is revoked while its writer writes (the page is quarantined under
 *   that writer); the revocation reaches the Run before any notice and decode drops it; the
 *   writer's EndWrite(success) frees the page and, unchecked, logs a notice; the Run verifies its
 *   own complete bytes and reads, with no Validate, a page the other request now leases and writes
 *   (P1, or P2). The old path's no_validate, through the notice.
 * Both requests use Decode.Run (-DRUNPATH=3, the configuration of model-both-run).
 */
#define RUNPATH 3
#define MUT_NOTICE_UNCHECKED
#include "../pdserve.pml"
