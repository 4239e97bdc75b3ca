/*
 * Mutant: prefill sends no EndWrite when its BeginWrite failed
 * Guard removed: EndWrite (the abort acknowledgement) is sent always, also when
 *   BeginWrite's answer never came: the broker may have recorded the writer.
 * Counter-example: the BeginWrite reply is lost; prefill gives up without EndWrite; with a
 *   process-wide writer id its liveness never lapses, so the page is quarantined for ever
 *   (P5). services/prefill/servicer.py sends no EndWrite here either, but its per-write
 *   liveness lease lapses: redundant/no_endwrite_after_failed_begin_per_write_deep.pml.
 */
#define MUT_NO_ENDWRITE_ON_BEGIN_FAILURE
#include "../pdserve.pml"
