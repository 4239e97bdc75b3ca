/*
 * Mutant: revoke frees a reader's pages at once, as release does
 * Guard removed: LeaseTable.revoke quarantines the revoked owner's pages until lock_delay,
 *   because decode may still be mid-step until the revocation reaches it.
 * Counter-example: the lease is revoked, the notice is still on its way, the page is
 *   granted again and written; the old reader is still live on it (P2) and steps over the
 *   new bytes (P1).
 */
#define MUT_REVOKE_FREES
#include "../pdserve.pml"
