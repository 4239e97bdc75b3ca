/*
 * Mutant: a revocation may reach decode before a write-done notice logged earlier
 * Guard removed: the notice and the revocations are one log with one sequence number per pool, sent
 *   and handled in order (broker revocation_log / watch_stream, decode watch.py).
 * Counter-example: r0's write ends and its notice is logged; r0 is then revoked (its page
 *   quarantined); the revocation overtakes the notice and reaches a Run with no notice yet, which
 *   decode drops; lock_delay passes, the page is swept (no blind stop: the revocation arrived), granted
 *   to r1 and written; r0's notice arrives, r0 verifies and steps over r1's data (P1).
 * Both requests use Decode.Run (-DRUNPATH=3, the configuration of model-both-run).
 */
#define RUNPATH 3
#define MUT_NOTICE_UNORDERED
#include "../pdserve.pml"
