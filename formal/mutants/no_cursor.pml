/*
 * Mutant: revocations have no cursor
 * Guard removed: every revocation is logged with a per-pool sequence number, decode resumes
 *   from its cursor on resubscribe and re-validates its running leases after a gap
 *   (services/broker WatchRevocations, services/decode/watch.py).
 * Counter-example: a lease is revoked while its request runs; the stream drops the notice
 *   and stays up (heartbeats flow, so decode is not blind and does not stop); lock_delay
 *   passes, the page is granted to the other request and written; the old reader steps
 *   over it (P1, or P2 first).
 */
#define MUT_NO_CURSOR
#include "../pdserve.pml"
