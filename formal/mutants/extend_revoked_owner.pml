/*
 * Mutant: the broker grows an owner that holds no leases (issue 19, pages on demand)
 * Guard removed: Extend refuses an item (OWNER_NOT_LEASED) unless its owner holds leases in the pool now: not
 *   released, not revoked; here any owner that was ever granted in this epoch gets growth pages.
 * Counter-example: an Extend for r0 is on its way when the operator revokes r0 (or decode releases it); the
 *   broker then leases a growth page to r0, after the revocation, so no revocation covers it: decode, not yet
 *   told, steps into it; the notice comes, decode ends r0 and releases it at once (Scheduler._end), which
 *   frees the growth page (no writer on it) while the stalled step still writes it (P4); after a Release,
 *   nobody ever releases the page (P5: an invalid end state with a page leased).
 * -DGROWTH, the configuration of model-growth.
 */
#define GROWTH
#define MUT_EXTEND_REVOKED_OWNER
#include "../pdserve.pml"
