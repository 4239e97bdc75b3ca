/*
 * Mutant: allocation expiry releases from a snapshot of decode's allocation table
 * Guard removed: decode's allocation table has one owner; Decode / Run's take and expiry's (and the
 *   drain's) pop each hand an allocation out exactly once, atomically, and expiry releases only what
 *   it popped (issue 18, hole 1). Here, as in services/decode/watch.py expire_allocations before the
 *   fix, expiry walks a snapshot, awaits each Release in turn, pops with pop(owner, None) and releases
 *   the snapshot's leases whether or not the pop found them.
 * Counter-example, in honest operation (no fault): r1's allocation is in expiry's snapshot; r1's write
 *   completes, Decode takes the allocation, verifies, validates and reads; expiry releases r1's
 *   leases: the broker frees the page at once and tells decode nothing; r0 is granted the page, its
 *   prefill writes it and r0 verifies it while r1 still reads it (P2); r1's next step would read r0's
 *   KV, its tag check passing while r0's data lands before its tag (P1).
 * -DEXPIRY with no fault, the configuration of model-expiry.
 */
#define EXPIRY
#define FAULTS 0
#define MUT_EXPIRY_SNAPSHOT
#include "../pdserve.pml"
