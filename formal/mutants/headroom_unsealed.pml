/*
 * Mutant: the headroom pages of a Grant stay open to a BeginWrite (issue 19, pages on demand)
 * Guard removed: the pages a Grant leases beyond the prompt (the headroom, written by decode alone) are sealed
 *   like Extend's growth pages, so no Prefill may begin a write on them; here, as in the code of main's
 *   working tree when this was written, only the pages a BeginWrite or Validate names are sealed, and prefill
 *   names the prompt's pages alone.
 * Counter-example: r0 is granted its prompt page and a headroom page at one generation; prefill writes the
 *   prompt; r0 steps into the headroom page; a second Prefill of r0 (replay, bug) names the headroom lease and
 *   writes another prompt's K/V and a tag whose ownership words are r0's; r0's next step passes its tag check
 *   and reads that K/V (P1). (The model's tags have no page_index: in the code the replay needs a destination
 *   that puts the page at the index decode expects, e.g. [h2, h1] for a one-page prompt.)
 * -DHEADROOM, the configuration of model-growth-headroom.
 */
#define HEADROOM
#define MUT_HEADROOM_UNSEALED
#include "../pdserve.pml"
