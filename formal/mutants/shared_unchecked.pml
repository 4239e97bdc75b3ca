/*
 * Mutant: decode reads a shared page without its checksum (issue 20, prefix reuse)
 * Guard removed: decode checks a shared page's bytes against the checksum the owner published (and its tag
 *   against the shared lease and its own chain key) before it sends the destination; here the tag only.
 * Counter-example: r1 publishes its page and ends; the unread cached page changes in place (a stray write, a
 *   bit flip); r0 shares it, its tag still matches, and r0's step reads the changed bytes (P1). With the check
 *   that is a miss: decode unpublishes the page (quarantined, unread) and its Grant takes a fresh page.
 * -DPREFIX, both requests on the old path, no hostile call of the default runs, r1 with r0's content.
 */
#define PREFIX
#define RUNPATH 0
#define NO_HOSTILE
#define R1ID 0
#define MUT_SHARED_UNCHECKED
#include "../pdserve.pml"
