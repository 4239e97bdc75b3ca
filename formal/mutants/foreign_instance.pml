/*
 * Mutant: the broker authorises a decode's lease calls by its role, not its instance
 * Guard removed: every id-bearing field of every broker call is authorised by the caller's instance
 *   identity (its own certificate): a decode names only its own pools, in Release, Grant, Validate,
 *   WatchRevocations and its reader KeepAlive, whose held_owners must hold leases in the caller's
 *   pools (issue 18, holes 3 and 4). Here, as with one certificate per role, a second decode instance
 *   may Release an owner of this decode's pool, and send a reader KeepAlive for it that lists no
 *   owner: the broker revokes every lease past the grace (NOT_HELD) and takes the KeepAlive for this
 *   decode's acknowledgement (-DFOREIGN, MUT_ROLE_AUTHZ bits 0 and 1).
 * Counter-example: r0's write completes; the other instance releases r0's lease: the broker frees the
 *   page at once and tells this decode nothing; r0 verifies on its notice and steps over a FREE page
 *   (P4: its step can still write it), which r1 may be granted and written (P1). The KeepAlive alone
 *   gives the same end (its revocation's page is freed on the false acknowledgement while r0's step
 *   runs).
 * -DSTEP_WRITES (the configuration of model-step-writes) and -DFOREIGN, with no fault: the other
 * instance's calls are enough.
 */
#define STEP_WRITES
#define FOREIGN
#define FAULTS 0
#define MUT_ROLE_AUTHZ 3
#include "../pdserve.pml"
