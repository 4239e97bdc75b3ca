/*
 * Mutant: prefill posts writes without checking its own liveness lease
 * Guard removed: worker.write's check_alive: before posting data and again before tags, the
 *   writer's liveness lease must hold with a margin.
 * Counter-example: the writer's liveness lapses while it still runs (stall, partition);
 *   expiry + lock_delay frees the page and the writer then posts into it (P4).
 */
#define MUT_NO_WRITER_FENCE
#include "../pdserve.pml"
