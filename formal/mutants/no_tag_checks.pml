/*
 * Mutant: decode never compares page tags with its leases
 * Guard removed: the ownership words of the tags (owner, epoch, generation, page_index) are
 *   compared nowhere: neither in verify_prompt_pages nor before each step. Either
 *   comparison alone covers the other: redundant/no_tag_match_deep.pml,
 *   redundant/no_step_tags_deep.pml.
 * Counter-example: prefill writes nothing and reports done; the previous tenant's page is
 *   self-consistent (num_tokens, checksum) and decode reads it (P1).
 */
#define MUT_NO_TAG_MATCH
#define MUT_NO_STEP_TAGS
#include "../pdserve.pml"
