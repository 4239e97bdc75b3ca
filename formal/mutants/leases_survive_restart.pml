/*
 * Mutant: leases survive a broker restart
 * Guard removed: a restart is a new LeaseTable with a new epoch: nothing of the old epoch
 *   validates, in-flight requests fail, pages return through quarantine (DESIGN §3 broker
 *   restart).
 * Counter-example: the restarted broker keeps the leases (decode hands them over) but
 *   cannot know their active writers; releasing a lease whose write is still in flight
 *   frees the page under it (P4).
 */
#define MUT_RESTART_KEEPS
#include "../pdserve.pml"
