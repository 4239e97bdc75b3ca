"""Shared fixtures: the default checkpoint and the reference oracle (DESIGN §7)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
