"""Conversions between protobuf messages and plain Python values shared by the services."""
from __future__ import annotations

import hashlib
import grpc
import numpy as np

from ..engine.grammar import spec_of
from ..engine.sampling_params import SamplingParams, TokenLogprobs
from .errors import from_rpc_error
from .proto import common_pb2


def leases_to_pb(leases: list[tuple[int, int]]) -> list:
    return [common_pb2.PageLease(page=p, generation=g) for p, g in leases]


def leases_from_pb(msgs) -> list[tuple[int, int]]:
    return [(m.page, m.generation) for m in msgs]


def prompt_digest(token_ids) -> bytes:
    """BLAKE2b-128 of the prompt's token ids (int32, little-endian): what ties a write-done notice to the prompt
    the Run was opened for."""
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i4").tobytes(), digest_size=16).digest()


def sampling_from_pb(m) -> SamplingParams:
    return SamplingParams(temperature=m.temperature, top_p=m.top_p or 1.0, seed=m.seed,
                          max_tokens=m.max_tokens, ignore_eos=m.ignore_eos, top_k=m.top_k,
                          frequency_penalty=m.frequency_penalty, presence_penalty=m.presence_penalty,
                          repetition_penalty=m.repetition_penalty or 1.0, stop_token_ids=tuple(m.stop_token_ids),
                          logprobs=m.logprobs if m.HasField("logprobs") else None,
                          logit_bias=tuple(sorted(m.logit_bias.items())), min_p=m.min_p, min_tokens=m.min_tokens,
                          grammar=spec_of(m.json_schema, m.json_object))


def logprobs_to_pb(lp: TokenLogprobs):
    return common_pb2.Logprobs(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs)


def layout_to_pb(layout, tag_nbytes: int):
    return common_pb2.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, page_size=layout.page_size, dtype=layout.dtype,
                               page_nbytes=layout.page_nbytes, tag_nbytes=tag_nbytes)


async def call(coro, what: str):
    """Awaits an outgoing RPC, turning its failure into a PdError with the callee's code, reason and retry delay."""
    try:
        return await coro
    except grpc.RpcError as e:
        raise from_rpc_error(e).prefixed(what) from None
