/*
 * Mutant: prefill reuses a failed write's source page at once
 * Guard removed: prefill keeps the local source pages of a failed or timed-out write out of
 *   reuse until the bound (services/prefill/servicer.py _finish / _free_local).
 * Counter-example: r0's transfer reports failure while its data write is still in flight;
 *   prefill frees r0's source page; r1's forward pass fills it; r0's late write reads it and
 *   lands r1's KV in r0's page (P6). The broker's hold keeps that page out of every lease
 *   until the bound, so P1 holds here; see formal/README.md.
 */
#define MUT_SOURCE_REUSE
#include "../pdserve.pml"
