/*
 * Mutant: a lease can be written twice
 * Guard removed: LeaseTable.begin_write refuses a write once one began on that lease
 *   generation (or decode validated it); the mutant only asks, as before, that the lease is
 *   current and has no active writer.
 * Counter-example: prefill writes r's page, decode verifies and validates it; a second
 *   Prefill of the same lease (a retry, a replay) writes another prompt's KV with tags whose
 *   ownership words still match; decode's step reads bytes it never verified (P1).
 */
#define MUT_REWRITE
#include "../pdserve.pml"
