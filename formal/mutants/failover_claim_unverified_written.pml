/*
 * Mutant: a claimed lease whose request is not reading yet is adopted as written
 * Guard removed: decode claims at a hand-over the requests decoding (model-failover-claim-subset): their pages
 *   were verified against an acknowledged write, sealed, so the new leader adopts them as written, with no writer.
 *   A held request that is not reading yet may still be written under the old term: its page, if claimed, keeps
 *   the adopted mark (an old-term writer may still land) until the old term drained.
 * Counter-example: decode claims r0 while its prefill still writes; the new leader adopts the page as written;
 *   r0 ends, its Release frees the page at once, and r1 is granted it while r0's old-term write can still land
 *   (P4).
 */
#define FAILOVER
#define CLAIM_SUBSET
#define MUT_FO_CLAIM_UNVERIFIED_WRITTEN
#define FAULTS 0          /* the failover alone */
#include "../pdserve.pml"
