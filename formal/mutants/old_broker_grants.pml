/*
 * Mutant: the old broker keeps accepting writes on a pool whose reader expired
 * Guard removed: LeaseTable refuses Grant, BeginWrite and writer renewals on a pool whose
 *   decode stopped renewing it (reader_ttl), and forgets it after the quarantine.
 * Counter-example: decode moved to a new broker and waited out the fence; the old broker,
 *   still running, accepts a BeginWrite of a lease from before the move after that wait, and
 *   the writer lands bytes on a page that the new incarnation has freed (P4) or re-granted.
 */
#define MUT_OLD_BROKER_GRANTS
#include "../pdserve.pml"
