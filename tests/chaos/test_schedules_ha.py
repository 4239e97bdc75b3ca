"""Seeded chaos schedules against broker replicas on a 3-member etcd (docs/design.md §3, "Leader failover"): the
load, faults and checks of test_schedules.py, with the leader killed (and started again as a standby), the
leader paused past its etcd lease, or an etcd member killed (and started again) while long streams on a shared
prefix run. Each long stream completes token for token unless a fault fired on it: a failover hands it over.
A failover explains no DATA_LOSS and no violation: every one must still be a fault's (attribution.py)."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.chaos.attribution import Record
from tests.chaos.conftest import CHAOS_EXTRA
from tests.chaos.test_schedules import LONG_STREAMS, run_schedule
from tests.integration.helpers import wait_for
from tests.integration.stack import Stack

NUM_SCHEDULES = 20
REQUESTS = 30
HA_DISRUPTIONS = ["kill_leader", "pause_leader", "kill_etcd_member", "kill_leader", "pause_leader"]
TTL = 2
SEEDS = [int(os.environ["PDSERVE_CHAOS_SEED"])] if os.environ.get("PDSERVE_CHAOS_SEED") else range(NUM_SCHEDULES)


def ha_extra() -> dict:
    """The chaos bounds, with a lock delay long enough for a blind bound that outlasts a failover (ttl 2 s)."""
    extra = {k: list(v) for k, v in CHAOS_EXTRA.items()}
    extra["broker"][extra["broker"].index("--lock-delay") + 1] = "8"
    extra["broker"] += ["--election-ttl", str(TTL), "--election-margin", "0.5"]
    extra["decode"][extra["decode"].index("--max-blind") + 1] = "3.5"
    return extra


@pytest.fixture(scope="module")
def ha_chaos(model_dir, tmp_path_factory):
    from pdserve.common.etcd_server import EtcdCluster
    etcd = EtcdCluster(tmp_path_factory.mktemp("etcd"), 3)
    etcd.start()
    stack = None
    try:
        # decode's pool twice the other chaos stack's: after a failover the old term's pages wait out its fence
        # (max_ttl + lock_delay, 13 s) while the four long streams grow to 107 of 128 pages, and the preemptions of
        # that dry spell, not the hand-over under test, ended them past --max-resubmissions
        stack = Stack(model_dir, num_prefill=2, prefill_pool_tokens=2048, decode_pool_tokens=4096, allow_small=True,
                      extra=ha_extra(), brokers=2, etcd=",".join(etcd.endpoints))
        stack.etcd = etcd
        yield stack
    finally:
        if stack is not None:
            stack.close()
        etcd.stop()


def leader_index(stack) -> int:
    def leads(i: int) -> bool:
        try:
            return stack.metric("broker", "pdserve_broker_leader", index=i) == 1
        except OSError:
            return False
    wait_for(lambda: any(leads(i) for i in range(len(stack.procs["broker"]))), 20, "a broker replica leads")
    return next(i for i in range(len(stack.procs["broker"])) if leads(i))


def disrupt_ha(stack, what: str, rng: random.Random, record: Record, streams) -> None:
    wait_for(lambda: all(s.running() or s.ended.is_set() for s in streams), 60, "every long stream under way")
    if what == "kill_etcd_member":
        member = stack.etcd.members[rng.randrange(3)]
        member.signal(signal.SIGKILL)
        time.sleep(rng.uniform(1.0, 3.0))
        stack.etcd.restart(member)
        return
    i = leader_index(stack)
    if what == "kill_leader":
        record.before_kill("broker", i)
        stack.restart("broker", i)  # killed, and started again on its ports as a standby
        return
    proc = stack.procs["broker"][i]
    os.killpg(proc.popen.pid, signal.SIGSTOP)  # past its etcd lease: the other replica takes over
    time.sleep(TTL + rng.uniform(0.5, 1.5))
    os.killpg(proc.popen.pid, signal.SIGCONT)


@pytest.mark.parametrize("seed", SEEDS)
def test_ha_chaos_schedule(ha_chaos, oracle, seed):
    disruption = HA_DISRUPTIONS[seed % len(HA_DISRUPTIONS)]
    run_schedule(ha_chaos, oracle, seed, disruption, disrupt_ha, LONG_STREAMS, requests=REQUESTS)
