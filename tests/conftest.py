"""Shared fixtures: the default checkpoint and the reference oracle (DESIGN §7)."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The test process computes its references on one intra-op thread. `make test` checks the formal model beside
# pytest on the same cores; with two torch threads on a 2-core machine every parallel region waits for whichever
# thread SPIN holds descheduled (test_paged_decode_logits_match_transformers[300]: 62-104 s against 0.7 s). The
# services the tests start pick their own threads (engine.runner.set_threads).
torch.set_num_threads(1)

# Every Mooncake the tests start (in this process and in the services it launches, which inherit the environment)
# draws its two listening ports from 15002-17000, not Mooncake's default 15000-17000: the manifests' decode listens
# on 15000 and 15001 (--transfer-port 15000), and tests/deploy launches it on those ports beside the integration
# stream, where a stack's random draw of either one made the launch refuse to start ("ports ... are taken").
# A service given --transfer-port still pins its own pair (kvtransfer.engine._pin_ports).
os.environ.setdefault("MC_MIN_RPC_PORT", "15002")
os.environ.setdefault("MC_MAX_RPC_PORT", "17000")


@pytest.fixture(autouse=True)
def _stdlib_event_loop():
    """Every asyncio.run in the test process runs on the standard library's loop, as the services do. Importing
    guidellm installs uvloop's policy process-wide, and a broker test's grpc.aio loop on uvloop once slept in
    epoll_wait for 25 minutes of a fresh clone's `make test` (a wake-up lost; a debugger's attach woke it). A test
    that leaves another policy behind fails here, and the policy is put back for the tests after it."""
    yield
    policy = asyncio.get_event_loop_policy()
    if type(policy) is not asyncio.DefaultEventLoopPolicy:
        asyncio.set_event_loop_policy(None)
        pytest.fail(f"this test left the asyncio event loop policy {type(policy).__module__}."
                    f"{type(policy).__qualname__} installed (the services run the standard library's loop)")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The embedded default checkpoint (`make test` creates it), else a fresh one with the same seed."""
    default = os.path.join(ROOT, "models", "pdserve-tiny")
    if os.path.exists(os.path.join(default, "model.safetensors")):
        return default
    from pdserve.engine.make_model import make_model
    return make_model(str(tmp_path_factory.mktemp("model") / "pdserve-tiny"), "tiny", 0)


@pytest.fixture(scope="session")
def oracle(model_dir):
    from tests.oracle import Oracle
    return Oracle(model_dir)
