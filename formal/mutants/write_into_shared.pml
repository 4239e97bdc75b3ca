/*
 * Mutant: a BeginWrite is accepted on a cached page (issue 20, prefix reuse)
 * Guard removed: a CACHED page is sealed: no BeginWrite may name it (LeaseTable.begin_write takes only the
 *   caller's LEASED pages), so nothing writes a page once it is shared.
 * Counter-example: r0 publishes its page and r1 shares it; a Prefill naming the shared lease (a replay, a bug)
 *   writes another prompt's KV and a tag whose ownership and chain words still match into the cached page; a
 *   reader's next step passes its tag check and reads it (P1).
 * -DPREFIX, r1 with r0's content (the share).
 */
#define PREFIX
#define R1ID 0
#define MUT_WRITE_INTO_SHARED
#include "../pdserve.pml"
