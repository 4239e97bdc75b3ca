/*
 * Mutant: an acknowledgement matched without its generation
 * Guard removed: LeaseTable.end_write clears active_writer only if it equals (writer_id,
 *   generation).
 * Counter-example: with one writer id per prefill process, an EndWrite of an earlier lease
 *   of the same page (a late duplicate, or the EndWrite that a refused write still sends)
 *   arrives while the same writer writes a later lease; it clears that write, and the page
 *   is freed while it can still land bytes (P4). With the per-write writer ids of
 *   services/prefill/servicer.py this guard is a second one:
 *   redundant/ack_without_generation_per_write_deep.pml.
 */
#define MUT_ACK_NO_GEN
#include "../pdserve.pml"
