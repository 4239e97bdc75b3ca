/*
 * Mutant: re-grant without waiting for the writer
 * Guard removed: LeaseTable._end_leases (release, revoke) frees a page at once even while a
 *   writer is active: no QUARANTINED state (DESIGN §3 page states).
 * Counter-example: the lease ends (revoked or released) between its writer's BeginWrite and
 *   EndWrite; the page is FREE while that writer can still land bytes on it (P4), and a
 *   later lease would read them (P1).
 */
#define MUT_REGRANT
#include "../pdserve.pml"
