"""The prefill worker's packed pass: a prompt split into chunks and packed beside others gets the first token
(greedy and seeded), its log-probabilities and its prompt log-probabilities that it gets alone in one pass."""
from types import SimpleNamespace

import pytest

from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SamplingParams
from pdserve.prefill.local_pages import Reservation
from pdserve.prefill.worker import PrefillWorker, Prompt


@pytest.fixture(scope="module")
def worker(model_dir):
    runner = ModelRunner(model_dir, num_pages=32, page_size=16, device="cpu")
    return PrefillWorker(runner, SimpleNamespace(register=lambda ptr, nbytes: None))  # no transfer in this test


def _prompt(n: int, salt: int, pages: list[int], **sampling) -> Prompt:
    ids = [(salt * 31 + 7 * i * i) % 509 + 2 for i in range(n)]
    return Prompt(ids, SamplingParams(**sampling), prompt_logprobs=3, reservation=Reservation(pages))


@pytest.mark.parametrize("sampling", [dict(logprobs=2), dict(temperature=0.8, top_p=0.9, seed=5, logprobs=1)])
def test_chunked_and_packed_prompt_gets_what_it_gets_alone(worker, sampling):
    alone = _prompt(70, 1, [0, 1, 2, 3, 4], **sampling)
    [whole] = worker.forward([(alone, 0, 70)])
    split = _prompt(70, 1, [10, 11, 12, 13, 14], **sampling)
    other = _prompt(9, 2, [20])
    assert worker.forward([(other, 0, 9), (split, 0, 30)])[1] is None  # not done after its first chunk
    done = worker.forward([(split, 30, 40)])[0]
    assert done.first_token == whole.first_token
    assert done.first_logprobs.top_ids == whole.first_logprobs.top_ids
    assert abs(done.first_logprobs.logprob - whole.first_logprobs.logprob) < 1e-4
    assert len(done.prompt_logprobs) == len(whole.prompt_logprobs) == 69  # one per prompt token from the second
    for a, b in zip(done.prompt_logprobs, whole.prompt_logprobs):
        assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-4
