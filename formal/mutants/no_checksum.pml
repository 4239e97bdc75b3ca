/*
 * Mutant: decode skips the checksum
 * Guard removed: verify_prompt_pages: the CRC-32C of the page bytes equals the tag's checksum
 *   (DESIGN §3 decode rule 1).
 * Counter-example: the data write is silently lost (or lands after the tag and is lost)
 *   while the tag lands; decode reads stale bytes under a correct tag (P1).
 */
#define MUT_NO_CHECKSUM
#include "../pdserve.pml"
