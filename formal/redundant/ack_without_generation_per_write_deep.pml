/*
 * Redundant with per-write writer ids (expected: errors: 0): mutants/ack_without_generation.pml under
 * -DWRITER_PER_WRITE, the writer identity services/prefill/servicer.py uses ("<worker>/<owner>":
 * one writer id and one liveness lease per write, no longer renewed once the write ends).
 * With a process-wide writer id (the default model) the mutant fails; see formal/README.md.
 */
#define WRITER_PER_WRITE
#define MUT_ACK_NO_GEN
#include "../pdserve.pml"
