/*
 * Mutant: decode releases a request while its step still runs (issue 19: preemption, a refused growth)
 * Guard removed: decode ends a request that still holds its leases (preemption when the pool runs dry, a
 *   client's cancel) only between steps, so its Release goes out once no step of it can still write; here a
 *   preemption decided while the step thread runs sends the Release at once.
 * Counter-example: r0's step into its growth page passes its check and stalls; r0 is preempted and released:
 *   no writer is active on its pages, so they are FREE at once while the step can still write the growth page
 *   (P4); granted to r1, r1 would read r0's late write (P1). The same holds for any Release of an owner with a
 *   step in flight: a revocation's Release is harmless only because the revocation ended the leases first.
 * -DGROWTH, the configuration of model-growth.
 */
#define GROWTH
#define MUT_RELEASE_DURING_STEP
#include "../pdserve.pml"
