"""Shared fixtures: the default checkpoint and the reference oracle (DESIGN §7)."""
from __future__ import annotations

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
