"""A greedy-id mismatch against vLLM judged at its first divergence: a near tie (both tokens within float32
rounding of the float64 maximum) or a defect; the run keeps what the judgement needs, and the report lists it."""
import pytest
import torch

from pdserve.bench.versus import protocol, report, ties
from pdserve.bench.versus.protocol import Cell
from pdserve.bench.versus.systems import TINY


def _rows(values: dict[int, float], rounding: float = 1e-5, vocab: int = 16) -> tuple[list[float], list[float]]:
    """A float64 row with the given logits (0 elsewhere), and a float32 row off from it by `rounding` at id 0."""
    row64 = [values.get(i, 0.0) for i in range(vocab)]
    row32 = list(row64)
    row32[0] += rounding
    return row32, row64


def test_a_near_tie_is_told_apart_by_which_token_float64_picks():
    # 5 and 7 are 3e-6 apart in float64, well inside 10 roundings of 1e-5; float32 ranked them the other way
    row32, row64 = _rows({5: 2.000003, 7: 2.0, 3: 1.5})
    row32[7], row32[5] = 2.000004, 2.000001
    vllm_right = ties.judge(row32, row64, ours=7, theirs=5, position=21)
    assert vllm_right.verdict == "near tie, fp64 picks vLLM's"
    assert vllm_right.pick64 == 5 and vllm_right.position == 21
    assert vllm_right.margin32 == pytest.approx(3e-6, abs=1e-12)
    assert vllm_right.gap64 == pytest.approx(-3e-6, abs=1e-12) and vllm_right.short_theirs == 0.0
    assert vllm_right.bound == pytest.approx(1e-4)
    assert ties.judge(row32, row64, ours=5, theirs=7, position=21).verdict == "near tie, fp64 picks pdserve's"


def test_a_third_token_on_top_is_still_a_tie_when_both_are_near_it():
    row32, row64 = _rows({5: 2.0, 7: 2.0 - 2e-5, 9: 2.0 + 1e-5})
    assert ties.judge(row32, row64, 5, 7, 3).verdict == "near tie, fp64 picks neither (token 9)"


def test_a_token_far_under_the_float64_maximum_is_a_defect_of_whoever_picked_it():
    row32, row64 = _rows({5: 2.0, 7: 1.999})   # 1e-3 apart: a hundred roundings
    j = ties.judge(row32, row64, ours=7, theirs=5, position=0)
    assert j.verdict.startswith("not a tie: a defect (pdserve's token 1.00e-03 under the float64 maximum, 100 ")
    assert j.pick64 == 5 and j.short_ours == pytest.approx(1e-3)
    assert "vLLM's" in ties.judge(row32, row64, ours=5, theirs=7, position=0).verdict
    # the same gap is a tie where the float32 reference itself rounded that far: the bound follows the rounding
    row32, row64 = _rows({5: 2.0, 7: 1.999}, rounding=2e-4)
    assert ties.judge(row32, row64, 7, 5, 0).verdict == "near tie, fp64 picks vLLM's"


def test_a_row_that_rounded_exactly_still_allows_an_ulp_of_its_largest_logit():
    row32, row64 = _rows({5: 8.0, 7: 8.0 - 5e-6}, rounding=0.0)
    assert ties.judge(row32, row64, 7, 5, 0).verdict == "near tie, fp64 picks vLLM's"   # 10 ulps of 8: 9.5e-6
    row32, row64 = _rows({5: 8.0, 7: 8.0 - 2e-5}, rounding=0.0)
    assert ties.judge(row32, row64, 7, 5, 0).verdict.startswith("not a tie")


def test_the_first_divergence():
    assert ties.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert ties.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert ties.first_divergence([1, 2], [1, 2, 3]) == 2


def test_the_run_keeps_the_mismatched_requests_ids_and_the_index_that_names_their_prompt():
    a = [[5, 6, 7], [5, 6, 7], None, [1, 2], [4]]
    b = [[5, 6, 7], [5, 9, 7], [1, 2, 3], [1, 3]]
    assert protocol.id_mismatches(a, b) == [{"index": 1, "ours": [5, 6, 7], "theirs": [5, 9, 7]},
                                            {"index": 3, "ours": [1, 2], "theirs": [1, 3]}]
    many = protocol.id_mismatches([[1]] * 50, [[2]] * 50)
    assert len(many) == protocol.MAX_KEPT_MISMATCHES and many[-1]["index"] == protocol.MAX_KEPT_MISMATCHES - 1


def test_a_mismatch_names_its_prompt_again():
    ps = protocol.prompts(Cell(64, 16), 2, "open", 10, 512)
    assert ties.prompt_of("64x16", 2, "open", 7, 512) == ps[7]
    assert ties.prompt_of("64x16", 1, "open", 7, 512) != ps[7]


@pytest.fixture(scope="module")
def reference():
    return ties.Reference(TINY)


def test_the_reference_finds_a_planted_wrong_token_a_defect(reference):
    """The checkpoint's own float64 greedy output against one with a token replaced at position 4 by the float64
    reference's least likely token there."""
    prompt = ties.prompt_of("48x1", 0, "closed", 0, 512)
    ids = prompt[:]
    for _ in range(8):
        ids.append(int(reference.rows(ids, torch.float64)[-1].argmax()))
    ours = ids[len(prompt):]
    assert reference.examine(prompt, ours, list(ours)) is None
    worst = int(reference.rows(prompt + ours[:4], torch.float64)[-1].argmin())
    j = reference.examine(prompt, ours, ours[:4] + [worst, *ours[5:]])
    assert (j.position, j.ours, j.theirs, j.pick64) == (4, ours[4], worst, ours[4])
    assert j.verdict.startswith("not a tie: a defect (vLLM's token") and j.gap64 > 0.1
    assert 0 < j.rounding < 1e-4   # float32 against float64 on this checkpoint: rounding, not a defect


class _Stub:
    """Stands in for the reference: records what it was asked, answers a fixed judgement."""

    def __init__(self):
        self.asked = []

    def examine(self, prompt, ours, theirs):
        self.asked.append((prompt, ours, theirs))
        row32, row64 = _rows({5: 2.000003, 7: 2.0})
        return ties.judge(row32, row64, 7, 5, ties.first_divergence(ours, theirs))


def _res(mismatches):
    toks = [{"system": "pdserve", "against": a, "round": 1, "cell": "128x4", "tag": "open", "compared": 10,
             "mismatched": len(mismatches), "first_divergence": 2 if mismatches else None,
             "mismatches": [dict(m) for m in mismatches]} for a in ("vLLM-CPU", "vLLM-CPU 2 cores")]
    return {"tokens": toks, "model": "unused", "model_facts": {"vocab_size": 512}}


def test_the_report_judges_each_kept_mismatch_once_and_lists_it():
    res = _res([{"index": 3, "ours": [4, 4, 7, 9], "theirs": [4, 4, 5, 2]}])
    stub = _Stub()
    report.judge_mismatches(res, stub)
    assert len(stub.asked) == 1   # one request, two vLLM configurations: one question
    assert stub.asked[0] == (ties.prompt_of("128x4", 1, "open", 3, 512), [4, 4, 7, 9], [4, 4, 5, 2])
    lines = report._mismatch_lines(res)
    rows = [x for x in lines if x.startswith("| pdserve |")]
    assert len(rows) == 2
    assert rows[0] == ("| pdserve | vLLM-CPU | 128x4 | 2 | open | 3 | 2 | 7 / 5 | 3.00e-06 | -3.00e-06 | 1.00e-04 "
                       "| near tie, fp64 picks vLLM's |")
    assert not any("without kept ids" in x for x in lines)
    report.judge_mismatches(res, None)   # judged already: no reference is loaded again


def test_the_report_says_where_a_counted_mismatch_kept_no_ids():
    res = _res([])
    for t in res["tokens"]:
        t.update(mismatched=1, first_divergence=21)
        del t["mismatches"]
    text = "\n".join(report._mismatch_lines(res))
    assert "2 mismatched requests (counted once per pdserve system and vLLM configuration) without kept ids" in text
    assert "--position K` looks for the near tie at 128x4 token 21." in text
    assert report._mismatch_lines({"tokens": [{**t, "mismatched": 0} for t in res["tokens"]]}) == []


# The committed side-by-side's one mismatch (round 2, closed loop, request 63 of cell 1,024 × 16, first differing at
# output token 21), recovered by find_ties: pdserve's engine's greedy output in float32, and the float64 reference's
# own (vLLM's ids were not kept by that run; the judgement reads only the token where they part).
KNOWN_PDSERVE = [89, 94, 479, 344, 406, 352, 474, 364, 5, 14, 325, 483, 134, 413, 467, 75, 320, 287, 288, 81, 166, 338,
                 274, 79, 142, 98, 357, 378, 404, 129, 237, 68]
KNOWN_FP64 = [89, 94, 479, 344, 406, 352, 474, 364, 5, 14, 325, 483, 134, 413, 467, 75, 320, 287, 288, 81, 166, 199,
              304, 32, 370, 266, 474, 476, 135, 369, 206, 56]


def test_the_known_divergence_is_a_near_tie_that_float64_breaks_the_other_way(reference):
    prompt = ties.prompt_of("1024x16", 1, "closed", 63, 512)
    j = reference.examine(prompt, KNOWN_PDSERVE, KNOWN_FP64)
    assert (j.position, j.ours, j.theirs, j.pick64) == (21, 338, 199, 199)
    assert j.verdict == "near tie, fp64 picks vLLM's"
    assert 1e-6 < -j.gap64 < 1e-5 and j.margin32 < 1e-5   # some 15 float32 ulps of a logit of 3.87
