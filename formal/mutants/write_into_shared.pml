/*
 * Mutant: a BeginWrite is accepted on a cached page (issue 20, prefix reuse)
 * Guard removed: a CACHED page is sealed: no BeginWrite may name it (LeaseTable.begin_write takes only the
 *   caller's LEASED pages), so nothing writes a page once it is shared.
 * Counter-example: r0 publishes its page and reads on (a sharer would do the same); a Prefill naming the
 *   shared lease (a replay, a bug) writes another prompt's KV and a tag whose ownership and chain words still
 *   match into the cached page; r0's step passes its tag check and reads it (P1).
 * -DPREFIX, both requests on the old path, no hostile call of the default runs, r1 with r0's content (the share).
 */
#define PREFIX
#define RUNPATH 0
#define NO_HOSTILE
#define R1ID 0
#define MUT_WRITE_INTO_SHARED
#include "../pdserve.pml"
