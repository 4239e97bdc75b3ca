/*
 * Mutant: a failed write's page becomes cached (issue 20, prefix reuse)
 * Guard removed: only decode's Publish makes a page CACHED, of a page it verified, the owner's current lease,
 *   written, with no active writer (a failed EndWrite's hold keeps the page writing until the bound); here the
 *   broker indexes a page under the chain the Grant named as soon as its write ends, failed or not.
 * Counter-example: r1's transfer reports failure while its writes are in flight; EndWrite(success=false)
 *   holds the page, and indexes it; the unread cached page is evicted for r0's Grant, FREE while r1's writes
 *   can still land (P4; then P1).
 * -DPREFIX, both requests on the old path, no hostile call of the default runs, r1 with r0's content.
 */
#define PREFIX
#define RUNPATH 0
#define NO_HOSTILE
#define R1ID 0
#define MUT_FAILED_WRITE_VISIBLE
#include "../pdserve.pml"
