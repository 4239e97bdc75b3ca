/*
 * Mutant: after a broker restart only the pages decode held go through quarantine
 * Guard removed: after a restart every page stays quarantined until the old incarnation's
 *   writers are drained, including pages released shortly before the restart whose writer
 *   was still active. services/decode/servicer.py today re-registers with pages_in_use()
 *   only.
 * Counter-example: a request is cancelled while its write is in flight (QUARANTINED in the
 *   old incarnation); the broker restarts and the page is FREE in the new epoch while that
 *   write can still land (P4).
 */
#define MUT_RESTART_HELDONLY
#include "../pdserve.pml"
