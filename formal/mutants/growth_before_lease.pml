/*
 * Mutant: decode writes its next page before the Extend reply leased it (issue 19, pages on demand)
 * Guard removed: a step writes a page only once decode holds that page's lease for the owner from a Grant or
 *   an Extend reply (Sequence.has_page_for_next_step: a sequence without a leased page for its next position
 *   does not step); here decode takes the page it expects the broker to give (the next one) as soon as it has
 *   asked, and stamps and writes it.
 * Counter-example: r0's prompt page is full and its Extend is on its way; decode takes the page after its
 *   own, which is FREE (or r1's), stamps its tag and steps into it: a FREE page that a step can still write
 *   (P4); granted to r1 and prefilled, r1 reads r0's K/V (P1), or both read it live (P2).
 * -DGROWTH, the configuration of model-growth.
 */
#define GROWTH
#define MUT_GROWTH_BEFORE_LEASE
#include "../pdserve.pml"
