/*
 * Mutant: decode's blind stop spares the Runs still waiting for their write-done notice
 * Guard removed: when decode has heard nothing on its stream for longer than the blind bound, it ends
 *   every request it holds, Runs waiting for their notice included (decode watch.py / scheduler).
 * Counter-example: r0's notice is logged, then r0 is revoked; the stream is down, so neither arrives;
 *   lock_delay passes: the page is swept and decode is blind, but r0 is spared; the page is granted to
 *   r1, which writes it; the stream comes back: r0's notice arrives first, r0 verifies its intact
 *   bytes, r1's data lands, r0 steps over it before its revocation arrives (P1).
 * Both requests use Decode.Run (-DRUNPATH=3, the configuration of model-both-run).
 */
#define RUNPATH 3
#define MUT_BLIND_SPARES_RUN
#include "../pdserve.pml"
