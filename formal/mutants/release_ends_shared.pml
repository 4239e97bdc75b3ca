/*
 * Mutant: a reader's Release ends the cached page (issue 20, prefix reuse)
 * Guard removed: Release (and Revoke) of one reader of a cached page removes only that reader's share; the
 *   page stays CACHED while it has other readers; here the Release ends the page as it ends a lease.
 * Counter-example, in honest operation: r1 publishes its page; r0 shares it; r1 ends and releases: the page is
 *   FREE under r0's reads, and the next Grant may take it and write it (P2: a live reader's page is FREE).
 * -DPREFIX, r1 with r0's content, no fault.
 */
#define PREFIX
#define R1ID 0
#define FAULTS 0
#define MUT_RELEASE_ENDS_SHARED
#include "../pdserve.pml"
