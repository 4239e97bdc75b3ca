/*
 * Mutant: decode keeps stepping while its revocation stream is down
 * Guard removed: decode stops every running request (UNAVAILABLE) once it has heard nothing on
 *   the stream (revocations, heartbeats) for longer than a bound under lock_delay
 *   (services/decode/watch.py). It replaces the assumption A3 of earlier versions ("a
 *   revocation reaches decode within lock_delay"; mutant revocation_notice_lost).
 * Counter-example: a lease is revoked while its request runs; the stream is down (the notice
 *   is delayed); lock_delay passes and the page leaves quarantine, is granted to the other
 *   request and written; the old reader, still blind, steps over it (P1, or P2 first).
 */
#define MUT_NO_BLIND_STOP
#include "../pdserve.pml"
