"""Prometheus metrics (prefix pdserve_). Counters are touched at start-up so they exist at 0."""
from __future__ import annotations

from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from .faults import FAULTS

LEASE_VIOLATIONS = Counter("pdserve_lease_violations_total", "Lease/tag/checksum violations caught",
                           ["service", "reason"])


def count_violation(service: str, reason: str, owner: bytes) -> None:
    """Counts a lease violation caught for request `owner`; with fault points on, it is also recorded with the
    owner, so a chaos test can tell which fault (if any) it was caught for (faults.py)."""
    LEASE_VIOLATIONS.labels(service, reason).inc()
    FAULTS.counted(service, reason, owner)


# an answer of a broker replica whose term had ended, refused by prefill or decode (a term they had already seen
# was newer): expected around a failover, rare, and each one is a stale authorisation not acted upon
OLD_TERM_ANSWERS = Counter("pdserve_old_term_answers_total", "Broker answers refused because their election term "
                           "was older than one this process had already seen", ["service", "rpc"])
OLD_TERM_RPCS = {"decode": ("RegisterPool", "KeepAlive", "WatchRevocations", "Grant", "Extend", "Validate"),
                 "prefill": ("KeepAlive", "BeginWrite")}
# decode's hand-overs of its pool to a new broker leader: kept (adopted, running requests go on) or refused (decode
# registered a new incarnation, as after a broker restart)
HANDOVERS = Counter("pdserve_decode_handovers_total", "Hand-overs of this decode's pool to a new broker leader",
                    ["outcome"])
HANDOVER_OUTCOMES = ("kept", "refused")
HANDOVER_REQUESTS = Counter("pdserve_decode_handover_requests_total", "Running requests a hand-over to a new broker "
                            "leader kept running")
ADMISSION_REJECTIONS = Counter("pdserve_admission_rejections_total", "Requests rejected at admission",
                               ["reason"])
TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total", "KV bytes written to decode pools (data + tags)")
TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds", "Wall time of one request's KV transfer",
                             buckets=(.00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
TRANSFER_FAILURES = Counter("pdserve_kv_transfer_failures_total", "Failed KV transfers", ["stage"])
POOL_CONTEXT_RATIO = Gauge("pdserve_kv_pool_context_ratio",
                           "Pool tokens / context length; < 1 means admission is capped by the pool",
                           ["pool"])
POOL_SHORTFALL = Gauge("pdserve_kv_pool_shortfall_tokens",
                       "Context tokens the pool cannot hold (started with --allow-pool-smaller-than-context)",
                       ["pool"])
TTFT = Histogram("pdserve_time_to_first_token_seconds", "Time to first token at the gateway",
                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
ITL = Histogram("pdserve_inter_token_latency_seconds", "Time between streamed tokens at the gateway",
                buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
FORWARD_SECONDS = Histogram("pdserve_forward_seconds", "Model forward pass (a prompt, or one decode step of the "
                            "batch), timed in the thread that runs it", ["phase"],
                            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
GUARD_SECONDS = Histogram("pdserve_guard_seconds",
                          "Time spent in lease RPCs, tag checks and checksums, by kind",
                          ["kind"], buckets=(.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1))
# begin_write_wait: what prefill still waits for KeepAlive + BeginWrite once its forward pass (which they
# overlap) is done
GUARD_KINDS = ("grant_rpc", "begin_write_rpc", "begin_write_wait", "end_write_rpc", "validate_rpc", "release_rpc",
               "checksum", "prompt_verify", "step_tag_check", "checksum_sweep", "prefix_check", "prefix_chain")
SWEEP_CYCLE_STEPS = Gauge("pdserve_checksum_sweep_cycle_steps",
                          "Decode steps within which every prompt page of the running batch is re-checksummed "
                          "(ceil(prompt pages / --checksum-sweep-pages); 0 when the sweep is off or idle)")
SAMPLING_FAILURES = Counter("pdserve_sampling_failures_total",
                            "Sequences ended because their own sampling failed (the rest of the step went on)")
TIMEOUTS = Counter("pdserve_timeouts_total", "Requests ended by the bound on a non-terminal state", ["stage"])
TIMEOUT_STAGES = ("queue", "prefill", "transfer", "validate", "allocation", "decode", "watch_blind")
CANARY_HITS = Counter("pdserve_canary_hits_total", "Verified pages found carrying a freed page's marker (canary mode)")
SOURCE_PAGES_HELD = Gauge("pdserve_prefill_source_pages_held",
                          "Prefill pages kept out of reuse until a failed write that read them can no longer land")
REQUESTS = Counter("pdserve_requests_total", "Finished requests by status code", ["code"])
# prefill's queue (issue 12): work dropped before its forward pass because its caller's deadline passed or its
# caller left; sequences whose forward pass ran; packed sequences per forward pass; queued sequences now
PREFILL_DROPPED = Counter("pdserve_prefill_dropped_total", "Prefill work dropped from the queue before its forward "
                          "pass (nothing computed, nothing posted)", ["reason"])
PREFILL_DROP_REASONS = ("deadline", "cancelled")
PREFILL_SEQUENCES = Counter("pdserve_prefill_sequences_total", "Prompts whose prefill forward pass ran (a chunked "
                            "prompt counts once)")
PREFILL_GONE_AT_START = Counter("pdserve_prefill_forward_for_gone_total", "Prompts whose forward pass started "
                                "although their caller had already left or its deadline had passed (should stay 0)")
PREFILL_BATCH = Histogram("pdserve_prefill_batch_sequences", "Sequences (or chunks) packed into one prefill forward "
                          "pass", buckets=(1, 2, 4, 8, 16, 32, 64))
PREFILL_QUEUE = Gauge("pdserve_prefill_queue_depth", "Prompts waiting for a prefill forward pass")
# prefill's own prefix cache (issue 20), in pages: prefix pages of prompts found cached (and checked) or not, pages
# found with changed bytes (dropped and recomputed: should stay 0), pages cached now
PREFIX_HIT_PAGES = Counter("pdserve_prefill_prefix_hit_pages_total", "Prompt prefix pages prefill reused from its "
                           "own cache (their forward pass skipped)")
PREFIX_MISS_PAGES = Counter("pdserve_prefill_prefix_miss_pages_total", "Prompt prefix pages prefill looked up in its "
                            "own cache and computed")
PREFIX_WAITS = Counter("pdserve_prefill_prefix_waits_total", "Times a prompt's first pass waited for another prompt "
                       "computing the same prefix (it then reuses those pages instead of computing them again)")
PREFIX_CORRUPT_PAGES = Counter("pdserve_prefill_prefix_corrupt_pages_total", "Cached prefix pages whose bytes no "
                               "longer had their recorded CRC-32C when reused: dropped, recomputed")
PREFIX_CACHED_PAGES = Gauge("pdserve_prefill_prefix_cached_pages", "Pages in prefill's own prefix cache")
# overload (issue 12): requests refused because a per-server concurrency limit or a queue was full
OVERLOAD_REJECTIONS = Counter("pdserve_overload_rejections_total", "Requests refused with RESOURCE_EXHAUSTED "
                              "because the service was saturated", ["service", "reason"])
# pages on demand (issue 19): growth pages leased by Extend, requests preempted when the pool ran dry, and requests
# the gateway resubmitted after a preemption
GROWTH_PAGES = Counter("pdserve_kv_growth_pages_total", "Pages decode leased to running sequences as they grew")
PREEMPTIONS = Counter("pdserve_preemptions_total", "Running requests decode preempted because its KV pool ran dry")
# decode's re-checks of running requests' leases after a gap or reconnect of its revocation stream, per request:
# current (it goes on), not_current (the broker ended the lease: DATA_LOSS, also a lease violation), unreachable (no
# answer: the request ends UNAVAILABLE, retryable; not a violation, nothing was found wrong), released (it finished
# and decode released it while the re-check was on its way: nothing to check)
LEASE_RECHECKS = Counter("pdserve_lease_rechecks_total", "Running requests whose leases decode re-checked with the "
                         "broker after its revocation stream reconnected or reported a gap, by outcome", ["outcome"])
RECHECK_OUTCOMES = ("current", "not_current", "unreachable", "released")
RESUBMISSIONS = Counter("pdserve_resubmissions_total", "Requests decode handed back (preempted, or drained) that "
                        "the gateway resubmitted (prompt + the tokens streamed) to continue their stream", ["outcome"])
PREFIX_LOOKUPS = Counter("pdserve_prefix_cache_lookup_pages_total",
                         "Decode: prompt pages looked up in its pool's prefix cache, by result (hit: shared and "
                         "checked; miss: not cached; refused: cached but failed its check, so recomputed)", ["result"])
PREFIX_REFUSED = Counter("pdserve_prefix_cache_refused_total",
                         "Decode: cached pages refused by their check before any read, by reason", ["reason"])
PREFIX_RESULTS = ("hit", "miss", "refused")
PREFIX_REFUSAL_REASONS = ("TAG_MISSING", "TAG_EPOCH", "TAG_GENERATION", "TAG_PAGE_INDEX", "TAG_NUM_TOKENS",
                          "TAG_CHAIN", "CHECKSUM")
# prefix reuse (issue 20): requests the gateway routed to the backend holding their prefix, or by load (no backend
# known to hold it, or the one that does is too loaded)
PREFIX_ROUTES = Counter("pdserve_gateway_prefix_routes_total", "Requests with a prefix scope the gateway routed, by "
                        "role and by what decided: affinity (the backend last sent their prefix) or load",
                        ["role", "result"])
C_HEAP = Gauge("pdserve_c_heap_bytes", "An engine process's C heap where it is glibc's (mallinfo2, every arena): "
               "in_use, or free and kept for the next forward pass; RSS swings by the free part, which grows as the "
               "heap fragments (services/engine/allocator.py)", ["state"])
PREFIX_ROUTE_ENTRIES = Gauge("pdserve_gateway_prefix_route_entries", "Entries the gateway's prefix route map holds, by "
                             "role, at most --prefix-route-entries: it grows to that bound, then stays (about 130 "
                             "bytes an entry)", ["role"])
# what to scale and page on (issue 21). HTTP requests by route template, never by path: a client's made-up path is
# route "other", so the series stay a fixed, small set whatever clients send
HTTP_REQUESTS = Counter("pdserve_http_requests_total", "HTTP requests the gateway's OpenAI front answered, by route "
                        "template and status code; route `other`: a path it does not serve or a request head it "
                        "could not parse; status 499: the client left before its answer", ["route", "status"])
HTTP_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "other")
HTTP_OTHER_ROUTE = "other"
HTTP_STATUSES = ("200", "400", "401", "404", "408", "413", "429", "499", "500", "503", "504")
PROMPT_TOKENS = Counter("pdserve_prompt_tokens_total", "Gateway: prompt tokens of generations (gRPC and HTTP) that "
                        "streamed a first token; each choice of n counts its prompt, a resubmission after a "
                        "preemption does not count it again")
GENERATION_TOKENS = Counter("pdserve_generation_tokens_total", "Gateway: tokens streamed to clients (gRPC and HTTP)")
# read at scrape time from the service's own counts (track_load): nothing is walked, the KV pool least of all
RUNNING = Gauge("pdserve_requests_running", "Requests at work now, by service. gateway: generations streaming "
                "tokens; prefill: prompts in a forward pass or being written to decode; decode: sequences in (or "
                "joining) the running batch", ["service"])
WAITING = Gauge("pdserve_requests_waiting", "Requests accepted and waiting, by service. gateway: generations "
                "without a first token yet; prefill: prompts queued for a forward pass; decode: requests queued "
                "for KV pages (the pool is full)", ["service"])
LOAD_SERVICES = ("gateway", "prefill", "decode")
QUEUE_SECONDS = Histogram("pdserve_queue_time_seconds", "Time a request waited for capacity, by service. prefill: "
                          "from its arrival in the queue to its first forward pass; decode: from its arrival to "
                          "its KV pages granted (the queue while the pool is full, plus the broker's Grant)",
                          ["service"], buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
QUEUE_SERVICES = ("prefill", "decode")

VIOLATION_REASONS = ("COVERAGE_MISMATCH", "TAG_MISSING", "TAG_OWNER", "TAG_EPOCH", "TAG_GENERATION",
                     "TAG_PAGE_INDEX", "TAG_NUM_TOKENS", "CHECKSUM", "STEP_TAG_MISMATCH",
                     "LEASE_NOT_CURRENT", "WRITER_ACTIVE", "EPOCH_MISMATCH", "REVOKED", "CANARY",
                     "LEASE_ALREADY_WRITTEN", "DESTINATION_MISMATCH", "PROMPT_PAGE_CHANGED", "NOTICE_MISMATCH",
                     "PROMPT_MISMATCH", "GROWTH_REFUSED", "TAG_CHAIN")
ADMISSION_REASONS = ("EMPTY_PROMPT", "PROMPT_TOO_LONG", "CONTEXT_EXCEEDED", "DECODE_POOL_EXCEEDED",
                     "PREFILL_POOL_EXCEEDED", "BAD_MAX_TOKENS", "TOKEN_OUT_OF_VOCAB", "BAD_TEMPERATURE",
                     "BAD_TOP_P", "OVERLOADED", "LAYOUT_MISMATCH", "BAD_DESTINATION")
RESUBMISSION_OUTCOMES = ("resubmitted", "gave_up")  # gave_up: past --max-resubmissions, the client gets the error
TRANSFER_STAGES = ("data", "tags", "begin_write", "end_write", "liveness", "timeout")
CODES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DATA_LOSS", "DEADLINE_EXCEEDED",
         "CANCELLED", "INTERNAL", "FAILED_PRECONDITION", "NOT_FOUND", "UNKNOWN")


def init_metrics(service: str, pools: list[str] = ()) -> None:
    """Creates every labelled series this service exports, at 0."""
    for r in VIOLATION_REASONS:
        LEASE_VIOLATIONS.labels(service, r)
    for r in ADMISSION_REASONS:
        ADMISSION_REJECTIONS.labels(r)
    for s in TRANSFER_STAGES:
        TRANSFER_FAILURES.labels(s)
    for c in CODES:
        REQUESTS.labels(c)
    for t in TIMEOUT_STAGES:
        TIMEOUTS.labels(t)
    for k in GUARD_KINDS:
        GUARD_SECONDS.labels(k)
    for phase in ("prefill", "decode"):
        FORWARD_SECONDS.labels(phase)
    for r in PREFILL_DROP_REASONS:
        PREFILL_DROPPED.labels(r)
    for o in RESUBMISSION_OUTCOMES:
        RESUBMISSIONS.labels(o)
    for rpc in OLD_TERM_RPCS.get(service, ()):
        OLD_TERM_ANSWERS.labels(service, rpc)
    if service == "decode":
        for o in HANDOVER_OUTCOMES:
            HANDOVERS.labels(o)
        for o in RECHECK_OUTCOMES:
            LEASE_RECHECKS.labels(o)
        for r in PREFIX_RESULTS:
            PREFIX_LOOKUPS.labels(r)
        for r in PREFIX_REFUSAL_REASONS:
            PREFIX_REFUSED.labels(r)
    if service == "gateway":
        for role in ("prefill", "decode"):
            for result in ("affinity", "load"):
                PREFIX_ROUTES.labels(role, result)
        for route in HTTP_ROUTES:
            for status in HTTP_STATUSES:
                HTTP_REQUESTS.labels(route, status)
    if service in LOAD_SERVICES:
        RUNNING.labels(service)
        WAITING.labels(service)
    if service in QUEUE_SERVICES:
        QUEUE_SECONDS.labels(service)
    for p in pools:
        POOL_CONTEXT_RATIO.labels(p)
        POOL_SHORTFALL.labels(p)


def track_load(service: str, load: Callable[[], tuple[int, int]]) -> None:
    """pdserve_requests_running and _waiting of this service, as load() returns them (running, waiting) at each
    scrape. load runs in the metrics server's thread: it may read counts, never walk a structure the event loop
    changes."""
    RUNNING.labels(service).set_function(lambda: load()[0])
    WAITING.labels(service).set_function(lambda: load()[1])
