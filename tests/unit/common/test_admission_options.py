"""Admission of the sampling options: each bad value is INVALID_ARGUMENT with its reason and numbers."""
import math

import pytest

from pdserve.common.admission import MAX_STOP_CHARS, check_options, check_stop_strings
from pdserve.engine.sampler import SamplingParams
from tests.unit.common.test_admission import _rejected

VOCAB = 512


@pytest.mark.parametrize("field,value,reason,numbers", [
    ("top_k", VOCAB + 1, "BAD_TOP_K", [VOCAB + 1, VOCAB]),
    ("frequency_penalty", 2.5, "BAD_PENALTY", [2.5, "frequency_penalty"]),
    ("presence_penalty", -2.01, "BAD_PENALTY", [-2.01, "presence_penalty"]),
    ("presence_penalty", math.nan, "BAD_PENALTY", ["nan"]),
    ("repetition_penalty", 0.0, "BAD_PENALTY", [0.0]),
    ("repetition_penalty", -1.0, "BAD_PENALTY", [-1.0]),
    ("repetition_penalty", math.inf, "BAD_PENALTY", ["inf"]),
    ("stop_token_ids", (3, VOCAB), "BAD_STOP", [VOCAB]),
    ("stop_token_ids", (-1,), "BAD_STOP", [-1]),
    ("stop_token_ids", tuple(range(65)), "BAD_STOP", [65, 64]),
    ("logprobs", 21, "BAD_LOGPROBS", [21, 20]),
])
def test_bad_option_is_refused_with_its_numbers(field, value, reason, numbers):
    _rejected(check_options, SamplingParams(**{field: value}), VOCAB, reason=reason, numbers=numbers)


def test_bad_prompt_logprobs_is_refused():
    _rejected(check_options, SamplingParams(), VOCAB, 25, reason="BAD_LOGPROBS", numbers=[25, "prompt_logprobs"])


def test_edges_are_admitted():
    check_options(SamplingParams(top_k=VOCAB, frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1e-3,
                                 stop_token_ids=(0, VOCAB - 1), logprobs=20), VOCAB, 0)
    check_stop_strings(["a", "x" * MAX_STOP_CHARS, "\n\n", "END"])


@pytest.mark.parametrize("stop,numbers", [(["a"] * 5, [5, 4]), (["ok", ""], [1, 0]),
                                           (["x" * (MAX_STOP_CHARS + 1)], [MAX_STOP_CHARS + 1, MAX_STOP_CHARS])])
def test_bad_stop_strings_are_refused(stop, numbers):
    _rejected(check_stop_strings, stop, reason="BAD_STOP", numbers=numbers)
