/*
 * Mutant: decode skips the broker Validate after verifying the prompt pages
 * Guard removed: DESIGN §3 decode rule 2: Validate (leases current, no writer active).
 * Counter-example: the lease is revoked while prefill still writes; the page is quarantined
 *   under that writer, whose EndWrite frees it before the revocation reaches decode; decode
 *   verifies its own, complete bytes and starts reading while the page is granted to
 *   another request (P2), whose data it then reads (P1).
 */
#define MUT_NO_VALIDATE
#include "../pdserve.pml"
