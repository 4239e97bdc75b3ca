/*
 * Mutant: a growth page accepts a BeginWrite (issue 19, pages on demand)
 * Guard removed: Extend seals a growth page's generation at once (sealed_generation), so no Prefill may ever
 *   begin a write on it: decode alone writes a growth page; here it is open to one write, as a prompt page is.
 * Counter-example: r0 grows; a second Prefill of r0's lease (replay, retry, bug) names the growth lease and
 *   writes another prompt's K/V and a tag whose ownership words are r0's growth lease; r0's next step passes
 *   its tag check and reads that K/V (P1).
 * -DGROWTH, the configuration of model-growth.
 */
#define GROWTH
#define MUT_GROWTH_UNSEALED
#include "../pdserve.pml"
