"""What each mode measures, and what it skips and why (2 CPU cores, no GPU: the full matrix does not fit).

Prompt "4096" is 4,064 tokens: the checkpoints' max_position_embeddings (the stack's context length)
is 4,096, and prompt + max_tokens (32) must fit in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..harness.workload import MAX_TOKENS

CONTEXT = 4096
LONG = CONTEXT - MAX_TOKENS
PROMPT_LENS = (128, 1024, LONG)
CONCURRENCY = (1, 4, 16, 64)


@dataclass(slots=True, frozen=True)
class Cell:
    prompt_len: int
    concurrency: int
    num_requests: int


@dataclass(slots=True, frozen=True)
class Sweep:
    """TTFT/ITL against offered load (Poisson arrivals) at multiples of each system's saturation throughput."""
    prompt_len: int
    saturation: Cell                       # the closed loop whose req/s is taken as a system's saturation
    multiples: tuple[float, ...]           # offered load per level, × that system's saturation
    seconds: float                         # arrival window per level: rate × seconds requests ...
    min_requests: int                      # ... at least this many (low rates) ...
    max_requests: int                      # ... at most this many (what 2 cores can send and serve)
    unloaded_requests: int = 4             # co-located one at a time: the TTFT the SLO is a multiple of


@dataclass(slots=True)
class PresetPlan:
    preset: str
    cells: list[Cell]
    hf_requests: int                       # transformers requests per prompt length (serial)
    probe_requests: int = 6                # paired one-at-a-time requests per prompt length (TTFT gap, transfer)
    # checksum on/off A/B (needs a second stack): a concurrency-1 cell for TTFT, a loaded one for throughput
    ab: tuple[Cell, ...] = ()
    flood: Cell | None = None              # admitted traffic for the over-long flood A/B
    profile: tuple[Cell, ...] = ()         # py-spy'd pdserve and co-located runs
    guidellm: tuple[Cell, ...] = ()        # guidellm over HTTP, then pdserve's own client, same load
    sweep: tuple[Sweep, ...] = ()          # open-loop load sweeps, pdserve and co-located


@dataclass(slots=True)
class Plan:
    mode: str
    presets: list[PresetPlan]
    repeats: int                           # interleaved A/B pairs
    raw_repeats: int
    flood_seconds: float
    admission_iters: int
    skipped: list[str] = field(default_factory=list)


def _cells(spec: dict[int, dict[int, int]]) -> list[Cell]:
    return [Cell(p, c, n) for p, row in spec.items() for c, n in row.items()]


def quick() -> Plan:
    tiny = PresetPlan("tiny", _cells({128: {1: 3, 4: 8, 16: 16}, 1024: {1: 3, 4: 8, 16: 16}}), hf_requests=2,
                      ab=(Cell(1024, 1, 3), Cell(128, 16, 16)), flood=Cell(128, 4, 8),
                      guidellm=(Cell(128, 1, 4), Cell(128, 4, 16)),
                      sweep=(Sweep(128, Cell(128, 16, 32), (0.5, 1.0, 2.0, 4.0), 2.0, 8, 160),))
    return Plan("quick", [tiny], repeats=3, raw_repeats=5, flood_seconds=1.5, admission_iters=1000, skipped=[
        "quick: small preset (its checkpoint, a second stack and a 107M-parameter model on 1 CPU thread per "
        "service cost minutes) — run `make bench`",
        f"quick: tiny prompt {LONG} and concurrency 64 (a 4,064-token prefill takes ~1.3 s on one CPU thread)",
        "quick: the py-spy profiles of each service (`make bench` takes them)",
        "quick: the load sweep at prompt 128 only, 4 levels over 2 s each (`make bench` adds 0.25× and prompt 1024, "
        "over 4-6 s per level)",
    ])


def full() -> Plan:
    tiny = PresetPlan("tiny", _cells({
        128: {1: 8, 4: 16, 16: 64, 64: 128},
        1024: {1: 4, 4: 8, 16: 32, 64: 64},
        LONG: {1: 2, 4: 4, 16: 16},
    }), hf_requests=3, probe_requests=8, ab=(Cell(1024, 1, 6), Cell(128, 16, 32)), flood=Cell(128, 4, 16),
        profile=(Cell(1024, 16, 32),),
        guidellm=(Cell(128, 1, 8), Cell(128, 16, 64)),
        sweep=(Sweep(128, Cell(128, 32, 96), (0.25, 0.5, 1.0, 2.0, 4.0), 4.0, 12, 400),))
    small = PresetPlan("small", _cells({128: {1: 2, 4: 8, 16: 16}, 1024: {1: 2}}), hf_requests=2,
                       probe_requests=4)
    return Plan("full", [tiny, small], repeats=5, raw_repeats=10, flood_seconds=3.0, admission_iters=3000,
                skipped=[
        f"tiny prompt {LONG} × concurrency 64: the decode pool (2,048 pages) holds 8 such requests (256 pages "
        "each); 64 would wait ~80 s behind a serial 1.3 s prefill each, past the gateway's 30 s queue timeout",
        "small prompt 1024 × concurrency 4 and up: a 1,024-token prefill of the 107M model takes ~4.5 s on one "
        "CPU thread, so 16 of them queue ~70 s in prefill, past the gateway's 60 s Prefill deadline (a trial run "
        "ended 13 of 16 requests with DEADLINE_EXCEEDED), and even 4 cost a minute of `make bench`'s hour; "
        "concurrency 1 shows the model's prefill cost",
        "small concurrency 64 at prompt 128: 64 prefills of ~0.45 s each queue ~29 s in prefill, at the "
        "gateway's 30 s queue bound, and a batch-64 decode step takes ~0.35 s; the 16-way cell shows the trend",
        f"small prompt {LONG}: one prefill takes ~20 s on one CPU thread",
        "checksum A/B and the over-long flood run on the tiny preset only (both are per-request costs that "
        "the bigger model only dilutes)",
        "the load sweep at prompt 1024 (the side by side measures open-loop TTFT at 1,024 against vLLM), guidellm "
        "at 128 × 4 and 1,024 × 4 (128 × 1 and × 16 bracket them, and a second prompt length costs guidellm ~25 s "
        "of start-up), and the py-spy profile of 128 × 16 (1,024 × 16 is taken): make bench's hour holds the vLLM "
        "side by side (~40 min) too",
    ])
