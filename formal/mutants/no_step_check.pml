/*
 * Mutant: decode skips the check before each step
 * Guard removed: scheduler: before every step, a request whose lease was revoked or whose
 *   epoch ended stops, and the tags of the pages the step reads are compared with the
 *   leases (DESIGN §3 decode rules 3 and 4).
 * Counter-example: after Validate the lease ends (a revocation, or a broker restart) and
 *   the page, once out of quarantine, is granted to another request whose data lands; the
 *   old reader steps over it (P1).
 */
#define MUT_NO_STEP_CHECK
#include "../pdserve.pml"
