"""bench/scenarios/chunked_prefill.py: its pairs time the same work (a prompt whole and in chunks, the same logits),
and a chunked answer that differs from the whole one stops the run instead of giving a ratio."""
import os

import pytest

from pdserve.bench.harness.common import ROOT
from pdserve.bench.scenarios.chunked_prefill import PAGE_SIZE, measure
from pdserve.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(os.path.join(ROOT, "models", "pdserve-tiny"), num_pages=8, page_size=PAGE_SIZE,
                       prefill_only=True)


def test_a_row_for_chunks_that_end_inside_a_page(runner):
    row = measure(runner, 96, 40, reps=2)
    assert row["length"] == 96 and row["chunk"] == 40
    assert row["whole_ms"] > 0 and row["chunked_ms"] > 0
    assert row["ratio"] == row["chunked_ms"] / row["whole_ms"]


def test_chunks_that_answer_otherwise_stop_the_run(runner, monkeypatch):
    real = runner.prefill_batch
    # a chunk after the first (start > 0) answers 1.0 off; the whole pass is one chunk from 0 and stays right
    monkeypatch.setattr(runner, "prefill_batch",
                        lambda chunks: [t + 1.0 if c.start else t for c, t in zip(chunks, real(chunks))])
    with pytest.raises(SystemExit, match="logits differ from the whole pass"):
        measure(runner, 96, 40, reps=2)
