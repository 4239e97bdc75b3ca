"""A broker replica's role in one term: follow (NOT_SERVING, every call refused), take over, lead (SERVING), until
the term is over (authority.py says why a table serves one term only). Also the replica's metrics."""
from __future__ import annotations

import asyncio
import logging
import secrets

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .authority import ElectedAuthority, SoleAuthority
from .election import RETRYABLE, Election, NotLeaderError

log = logging.getLogger(__name__)

class LeadershipCollector:
    """Read at each scrape: whether this replica leads, the term it leads or knows of, how long its authority has
    left, and the terms it won. A broker without election reports itself leading term 0, so the no-leader alert
    reads the same for both."""

    def __init__(self, authority: ElectedAuthority | SoleAuthority, registry: CollectorRegistry = REGISTRY):
        self.authority = authority
        registry.register(self)

    def collect(self):
        if not self.authority.elected:
            leading, term, left, won = True, 0, float("inf"), 0
        else:
            state = self.authority.election.state()
            leading = state.is_leader and not self.authority.lost()
            term, left, won = state.term, state.authority_left_s, state.terms_won
        yield GaugeMetricFamily("pdserve_broker_leader", "1 while this broker replica may authorise", value=leading)
        yield GaugeMetricFamily("pdserve_broker_term", "The election term this replica leads, else the newest it "
                                "knows a leader of (0: no election)", value=term)
        yield GaugeMetricFamily("pdserve_broker_authority_left_seconds", "How long this replica's authority lasts "
                                "without another etcd lease renewal (0 while it follows)", value=left if leading else 0)
        yield CounterMetricFamily("pdserve_broker_terms_won", "Election terms this replica has won", value=won)


async def lead_one_term(authority: ElectedAuthority, take_over, on_lead, on_lapse, on_term_over,
                        poll_s: float = 0.05) -> None:
    """Waits to win a term; `take_over(term)` loads what the term needs (the lease identity), then the replica
    answers (authority.begin, then `on_lead(term)`) until the term ends; then `on_term_over(why)`. Meanwhile
    `on_lapse(answering)` tells when its authority lapses and when it resumes within the same term. The authority bound lapses by the
    clock alone, so the waits poll as well as listening for changes."""
    election = authority.election
    while True:
        while not election.authorised():
            await _changed_or(election, 1.0)
        try:
            term = election.check()
            await take_over(term)
        except (NotLeaderError, *RETRYABLE) as e:  # lapsed, or lost while taking over: nothing answered yet
            log.warning("broker: taking over failed: %r; campaigning on", e)
            await asyncio.sleep(0.1)
            continue
        break
    authority.begin(term)
    await on_lead(term)
    answering = True
    while not authority.lost():
        await _changed_or(election, poll_s)
        if election.authorised() != answering:  # a lapse (etcd unreachable, no quorum) or its end
            answering = not answering
            await on_lapse(answering)
    await on_term_over(f"term {authority.term} is over (authority left {election.state().authority_left_s:.2f}s)")


async def shared_epoch(election: Election, cluster: str) -> int:
    """The lease identity every leader of `cluster` answers under (docs/design.md §3, "Leader failover"): drawn
    by the first leader, stored once in etcd by a transaction fenced on its term, read by every later one, so a
    failover changes no tag and no lease. Raises NotLeaderError (StaleTermError) when the term is not current."""
    key = f"/pdserve/{cluster}/broker/epoch".encode()
    tx = election.client.transactions
    drawn = str(secrets.randbits(64) or 1).encode()
    _, responses = await election.fenced_txn(compare=[tx.version(key) == 0], success=[tx.put(key, drawn), tx.get(key)],
                                             failure=[tx.get(key)])
    return int(responses[-1].response_range.kvs[0].value)


async def _changed_or(election, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(election.wait_changed(), timeout_s)
    except asyncio.TimeoutError:
        pass
