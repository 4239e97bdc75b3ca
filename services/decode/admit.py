"""What decode re-checks of a Decode call before it verifies a page: lengths, sampling options, the prompt ids."""
from __future__ import annotations

from ..common.admission import check_options, check_sampling, check_tokens
from ..common.errors import invalid
from ..common.wire import sampling_from_pb
from ..engine.sampler import SamplingParams
from .verify import Violation


def admit_decode(request, num_prompt_tokens: int, max_tokens: int, vocab_size: int,
                 ids_checked: bool = False) -> SamplingParams:
    """The request's sampling, once it fits its allocation (num_prompt_tokens, max_tokens). ids_checked: the
    prompt ids came with a prefix scope and were checked against the prompt's digest (reuse.plan_prefix)."""
    if request.num_prompt_tokens != num_prompt_tokens:
        raise Violation("COVERAGE_MISMATCH", f"decode asked for a {request.num_prompt_tokens}-token prompt; "
                                             f"allocated for {num_prompt_tokens}")
    s = request.sampling
    check_sampling(s.max_tokens, s.temperature, s.top_p or 1.0)
    if s.max_tokens > max_tokens:
        raise invalid("BAD_MAX_TOKENS", f"max_tokens {s.max_tokens} exceeds the {max_tokens} allocated")
    if not 0 <= request.first_token < vocab_size:
        raise invalid("TOKEN_OUT_OF_VOCAB", f"first token {request.first_token} outside the vocabulary")
    sampling = sampling_from_pb(s)
    check_options(sampling, vocab_size)
    ids = request.prompt_token_ids
    if sampling.repetition_penalty != 1.0:
        # the penalty counts prompt tokens: without them every step after the first would differ from prefill's
        if len(ids) != num_prompt_tokens:
            raise invalid("BAD_PROMPT_IDS", f"repetition_penalty {sampling.repetition_penalty} needs the "
                                            f"{num_prompt_tokens} prompt token ids; got {len(ids)}")
        check_tokens(ids, vocab_size)
    elif len(ids) and not ids_checked:
        raise invalid("BAD_PROMPT_IDS", f"{len(ids)} prompt token ids sent, but only repetition_penalty reads "
                                        f"them and it is off")
    return sampling
