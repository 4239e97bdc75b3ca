/*
 * Mutant: a re-grant keeps the page's generation
 * Guard removed: LeaseTable.grant takes a fresh generation from the pool's monotonic
 *   counter (DESIGN §3: a re-grant always takes a new generation).
 * Counter-example: an EndWrite of the page's earlier lease by the same writer id carries
 *   the same (writer, generation) as the write in progress and clears it; the page is freed
 *   under it (P4). Redundant with per-write writer ids:
 *   redundant/regrant_same_generation_per_write_deep.pml.
 */
#define MUT_SAMEGEN
#include "../pdserve.pml"
