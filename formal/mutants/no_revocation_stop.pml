/*
 * Mutant: decode compares tags before each step but does not stop on a revocation or an epoch change
 * Guard removed: DESIGN §3 decode rule 4 (stop at once on a revocation) and the restart
 *   rule (fail in-flight requests).
 * Counter-example: the lease ends under a running request (revocation or restart); once the
 *   page is granted again, the new data lands before its tag, so the tag comparison still
 *   passes and the old reader consumes foreign bytes (P1). A tag comparison cannot be the
 *   guard against a concurrent writer.
 */
#define MUT_NO_REVOCATION_STOP
#include "../pdserve.pml"
