/*
 * Mutant: a failed EndWrite frees the pages at once
 * Guard removed: LeaseTable.end_write(success=false) of a write that posted something keeps
 *   the pages "writing" until now + lock_delay (the enforced bound, max_landing <= lock_delay);
 *   only nothing_posted frees at once.
 * Counter-example: the transfer reports failure (a task failed, or Mooncake's timer expired)
 *   while its posted writes are still in flight; EndWrite(success=false) clears the writer,
 *   decode releases, and the page is FREE while a write can still land on it (P4).
 */
#define MUT_FAIL_FREES
#include "../pdserve.pml"
