/*
 * Redundant guard (expected: errors: 0): the check before every step still stops on a
 * revocation or an epoch change but no longer compares tags. Nothing else can change a
 * leased page under a live reader, and the prompt tags were compared in verify_prompt_pages,
 * so no counter-example exists. (Any write that could change a tag under a reader could
 * equally land its data first and its tag after the step, so a tag comparison cannot be
 * the guard against it: mutants/no_revocation_stop.pml.) mutants/no_tag_checks.pml and
 * mutants/no_step_check.pml fail.
 */
#define MUT_NO_STEP_TAGS
#include "../pdserve.pml"
