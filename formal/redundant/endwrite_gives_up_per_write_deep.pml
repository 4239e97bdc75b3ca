/*
 * Redundant with per-write writer ids (expected: errors: 0): mutants/endwrite_gives_up.pml under
 * -DWRITER_PER_WRITE, the writer identity services/prefill/servicer.py uses ("<worker>/<owner>":
 * one writer id and one liveness lease per write, no longer renewed once the write ends).
 * With a process-wide writer id (the default model) the mutant fails; see formal/README.md.
 */
#define WRITER_PER_WRITE
#define MUT_ENDWRITE_GIVEUP
#include "../pdserve.pml"
