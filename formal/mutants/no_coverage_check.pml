/*
 * Mutant: decode trusts prefill's "done" without checking coverage
 * Guard removed: verify_prompt_pages: the tags' num_tokens must add up to the prompt length
 *   (DESIGN §3 decode rule 1).
 * Counter-example: prefill writes one token of the page and its tag (num_tokens=1) and
 *   reports done, the incident; the tag, generation and checksum all match, and decode
 *   reads the other token cell, which still holds a previous tenant's KV (P1).
 */
#define MUT_NO_COVERAGE
#include "../pdserve.pml"
