/*
 * Mutant: a revoked page leaves quarantine although decode never learnt of the revocation
 * Guard removed: the assumption behind revoke's lock_delay: the revocation reaches decode
 *   (WatchRevocations) within lock_delay. services/broker/servicer.py today drops a
 *   revocation published while decode's stream is reconnecting (_fan_out hands events only
 *   to the watchers present, and drain_revocations empties the list).
 * Counter-example: the notice never arrives; the page is freed and granted again while the
 *   old reader still runs (P2) and steps over the new data (P1).
 */
#define MUT_REVOCATION_LOST
#include "../pdserve.pml"
