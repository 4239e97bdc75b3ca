/*
 * Mutant: leases never expire
 * Guard removed: decode's KeepAlive lists the owners it holds and the broker revokes,
 *   through quarantine, leases no live decode holds, and every lease of a pool whose decode
 *   stopped renewing (services/broker lease_table.py keep_alive / sweep).
 * Counter-example: Grant's reply is lost (or a Release fails); decode never holds that
 *   lease again and the page stays LEASED for ever (P5: invalid end state).
 */
#define LEASE_FAULTS
#define MUT_NO_LEASE_EXPIRY
#include "../pdserve.pml"
