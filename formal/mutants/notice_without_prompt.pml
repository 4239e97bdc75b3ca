/*
 * Mutant: a Run takes any write-done notice of its leases, whatever prompt was written
 * Guard removed: the notice carries a digest of the prompt the writer prefilled (EndWrite), and the
 *   Run compares it with its own prompt's (NOT in the protos of issue 12: see README, holes, 7).
 * Counter-example: a second Prefill of the Run's lease (retry, replay, bug) with another prompt wins
 *   BeginWrite; its EndWrite is a proper one (lease current, its writer active, success), so the
 *   broker logs a notice; the real prefill's BeginWrite is refused (one write per generation); the
 *   tags' ownership words and checksums match, and the Run reads the other prompt's KV (P1). On the
 *   old path decode waits for the answer of the Prefill the gateway made, which failed.
 * Both requests use Decode.Run (-DRUNPATH=3, the configuration of model-both-run).
 */
#define RUNPATH 3
#define MUT_NOTICE_NO_PROMPT
#include "../pdserve.pml"
