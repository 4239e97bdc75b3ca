/*
 * Redundant (expected: errors: 0): prefill takes a BeginWrite answer of the old term after it has seen the new
 * one (MUT_FO_BEGIN_IGNORES_TERM). The old leader answers nothing after the failover (A8: its authority ended
 * before another leader could be elected), and an answer it gave before, however late it arrives, starts a
 * write whose liveness only the old term renews: the write stops posting when the old term's writers lapse,
 * before the new leader frees anything they may reach. The check stays in the code as a second line against a
 * clock that breaks A8.
 */
#define FAILOVER
#define MUT_FO_BEGIN_IGNORES_TERM
#include "../pdserve.pml"
