/*
 * Mutant: a revocation ends only the pages of the owner's Grant (issue 19, pages on demand)
 * Guard removed: Extend appends growth pages to the owner's lease list, so Revoke (and Release, and
 *   reconciliation) end them with its prompt pages, through quarantine until decode's acknowledgement; here
 *   Revoke ends the Grant's pages and leaves the growth pages leased.
 * Counter-example: r0 grows and steps into its growth page; the operator revokes r0; the notice reaches decode,
 *   which ends r0 and releases it at once while the step thread is stalled: the growth page, still leased,
 *   is freed with no writer on it (P4), and r1 may be granted it and read r0's late write (P1).
 * -DGROWTH, the configuration of model-growth.
 */
#define GROWTH
#define MUT_REVOKE_SPARES_GROWTH
#include "../pdserve.pml"
