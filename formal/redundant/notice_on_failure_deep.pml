/*
 * Redundant guard (expected: errors: 0): the broker logs a write-done notice on EndWrite whatever
 * its success flag says (the lease current, this writer the active one). A failed write that posted
 * nothing leaves a previous tenant's tag (TAG_* fails); one whose data or tag did not land fails the
 * tag or checksum check; one that landed in full holds the Run's own bytes, and its late writes
 * carry the same bytes, while the page stays writing (FAILW) until the bound: verify_prompt_pages
 * and the failed write's hold cover it (with a fault budget of 1; the success check stays in code).
 */
#define MUT_NOTICE_ON_FAILURE
#include "../pdserve.pml"
