/*
 * Redundant guard (expected: errors: 0): verify_prompt_pages skips the owner/epoch/
 * generation/page_index match of the tags. The check before every step compares the same
 * words before anything is read, so no counter-example exists; mutants/no_tag_checks.pml
 * removes both and fails.
 */
#define MUT_NO_TAG_MATCH
#include "../pdserve.pml"
