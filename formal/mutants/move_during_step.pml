/*
 * Mutant: decode registers its new pool incarnation while a step is still in flight
 * Guard removed: on a move to a new broker incarnation (a broker restart, or its pool fenced) decode
 *   fails what runs, and waits for its step in flight to end before it registers the new incarnation
 *   (-DSTEP_WRITES: a step checks its tags, then writes its own KV into its page later).
 * Counter-example: r0's step passes its check and stalls; the broker restarts and decode moves at
 *   once; every page is quarantined for the fence (reader_ttl + max_ttl + lock_delay), which passes
 *   while the step thread is still stalled; the page is FREE in the new incarnation while r0's step
 *   can still write it (P4), and r1 may be granted it and read r0's late write (P1).
 * -DSTEP_WRITES, the configuration of model-step-writes.
 */
#define STEP_WRITES
#define MUT_MOVE_DURING_STEP
#include "../pdserve.pml"
