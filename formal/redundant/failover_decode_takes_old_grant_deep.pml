/*
 * Mutant: decode takes a Grant reply of an older term than the leader it handed its leases to
 * Guard removed: decode refuses any answer whose term is older than the newest it has seen; at a failover it
 *   has handed its leases to the new leader, which cannot know a lease decode learns of later.
 * Counter-example: the old leader grants a page and its reply is delayed past the failover; the new leader
 *   does not see the lease claimed, keeps the page in quarantine, then grants it to another request while the
 *   late reply's request reads it (P2).
 */
#define FAILOVER
#define MUT_FO_OLD_GRANT
#include "../pdserve.pml"
