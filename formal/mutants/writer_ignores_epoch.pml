/*
 * Mutant: prefill's liveness check ignores the broker epoch
 * Guard removed: a writer whose lease is of an earlier epoch stops posting once the broker
 *   restarted, so that the restart quarantine's lock_delay covers its last writes.
 *   services/prefill/servicer.py today renews and checks its liveness without looking at
 *   the epoch KeepAlive returns, and the new broker accepts the renewals.
 * Counter-example: a write begun before a restart still posts after the old incarnation's
 *   writers are presumed drained; its page is FREE in the new epoch while it can land bytes
 *   (P4).
 */
#define MUT_WRITER_IGNORES_EPOCH
#include "../pdserve.pml"
