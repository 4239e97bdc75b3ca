/*
 * Mutant: decode's re-check after a reconnect accepts exclusive leases only (the code before the fix)
 * Guard removed: a re-check passes a page the request shares or published as CACHED at the generation it read
 *   with the request among the readers; here only a page LEASED to it passes, as the first Validate does.
 * Counter-example, in honest operation: r0 writes, verifies and publishes its page (CACHED, r0 its reader); its
 *   revocation stream reconnects, decode re-checks r0, the broker refuses a page that is r0's to read, and r0
 *   ends DATA_LOSS (P7: a false alarm; in service every stream with a full prompt page, and the critical alerts).
 * -DPREFIX, r1 of another scope, no fault.
 */
#define PREFIX
#define R1ID 1
#define FAULTS 0
#define MUT_RECHECK_LEASED_ONLY
#include "../pdserve.pml"
