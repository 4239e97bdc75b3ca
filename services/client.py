"""`pdserve generate`: streams one completion from the gateway."""
from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from .common import config
from .common.errors import from_rpc_error
from .common.proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from .common.token_ids import parse_token_id

FINISH_NAMES = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
                common_pb2.FINISH_REASON_UNSPECIFIED: None}
# GenerateRequest fields a caller sets only when given (None: unset, the gateway's default applies)
OPTIONAL = ("top_p", "seed", "top_k", "repetition_penalty", "logprobs", "prompt_logprobs", "cache_salt", "min_p",
            "min_tokens", "json_schema", "json_object")


def _ids(text: str) -> list[int]:
    try:
        return [parse_token_id(x) for x in text.split(",")] if text else []
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(g) -> None:
    g.add_argument("prompt", nargs="?", default="")
    g.add_argument("--prompt-token-ids", type=_ids, default=None, help="comma-separated token ids instead of text")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: no limit)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], over output tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], over output tokens")
    g.add_argument("--repetition-penalty", type=float, default=None, help="> 0 (1: off), over prompt and output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable, at most 4)")
    g.add_argument("--stop-token-ids", type=_ids, default=[], help="comma-separated stop token ids")
    g.add_argument("--logprobs", type=int, default=None, help="log-probabilities with this many top tokens (0..20)")
    g.add_argument("--prompt-logprobs", type=int, default=None,
                   help="the prompt's log-probabilities with this many top tokens (0..20); with --json")
    g.add_argument("--cache-salt", default=None,
                   help="prefix caching scope within the key's tenant: requests with other salts share no cached KV")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than this times the most likely one, in [0, 1]")
    g.add_argument("--min-tokens", type=int, default=None, help="no end-of-sequence or stop before this many tokens")
    g.add_argument("--json-schema", default=None, help="JSON schema (text) the output must follow")
    g.add_argument("--json-object", action="store_true", default=None, help="the output must be one JSON object")
    g.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole request, seconds")
    g.add_argument("--gateway", default=f"127.0.0.1:{config.GATEWAY_PORT}")
    g.add_argument("--api-key", default=None,
                   help="the gateway's API key, sent as `authorization: Bearer KEY`; default: env PDSERVE_API_KEY "
                        "(preferred: a command line is visible to every local user)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def build_request(prompt: str = "", prompt_token_ids=None, max_tokens: int = 32, temperature: float = 0.0,
                  ignore_eos: bool = False, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  stop=(), stop_token_ids=(), **optional):
    """optional: any of OPTIONAL, None meaning unset."""
    if unknown := set(optional) - set(OPTIONAL):
        raise TypeError(f"unknown GenerateRequest options {sorted(unknown)}")
    req = gateway_pb2.GenerateRequest(prompt=prompt, prompt_token_ids=prompt_token_ids or [],
                                      max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                                      frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                      stop=stop, stop_token_ids=stop_token_ids)
    for name, value in optional.items():
        if value is not None:
            setattr(req, name, value)
    return req


def _logprobs(msgs) -> list[dict]:
    return [{"logprob": m.logprob, "top": [[t, lp] for t, lp in zip(m.top_token_ids, m.top_logprobs)]} for m in msgs]


def api_key_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def generate(stub, req, on_text=None, timeout: float = 300.0, api_key: str | None = None) -> dict:
    """Runs one Generate call; returns the --json result (or its error object)."""
    ids: list[int] = []
    text = []
    lps: list[dict] = []
    extra: dict = {}
    finish = None
    prompt_tokens = 0
    try:
        for r in stub.Generate(req, timeout=timeout, metadata=api_key_metadata(api_key)):
            ids.extend(r.token_ids)
            text.append(r.text)
            lps.extend(_logprobs(r.logprobs))
            if r.prompt_token_ids:
                extra = {"prompt_token_ids": list(r.prompt_token_ids), "prompt_logprobs": _logprobs(r.prompt_logprobs)}
            prompt_tokens = r.prompt_tokens or prompt_tokens
            if r.finish_reason:
                finish = FINISH_NAMES[r.finish_reason]
            if on_text and r.text:
                on_text(r.text)
    except grpc.RpcError as e:
        err = from_rpc_error(e)
        return {"error": {"code": err.code.name, "reason": err.reason, "message": err.message},
                "token_ids": ids}
    out = {"token_ids": ids, "text": "".join(text), "prompt_tokens": prompt_tokens, "finish_reason": finish}
    if req.HasField("logprobs"):
        out["logprobs"] = lps
    return {**out, **extra}


def _hint(err: dict, key: str | None) -> str:
    if err["reason"] != "API_KEY":
        return ""
    return " (no API key given: set PDSERVE_API_KEY or pass --api-key)" if not key else \
        " (the key given was refused)"


def main(args) -> int:
    key = args.api_key if args.api_key is not None else os.environ.get("PDSERVE_API_KEY")
    req = build_request(args.prompt or "", args.prompt_token_ids, args.max_tokens, args.temperature, args.ignore_eos,
                        args.frequency_penalty, args.presence_penalty, args.stop, args.stop_token_ids,
                        **{name: getattr(args, name) for name in OPTIONAL})
    with grpc.insecure_channel(args.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        if args.json:
            out = generate(stub, req, timeout=args.timeout, api_key=key)
            out.pop("token_ids", None) if "error" in out else None
            print(json.dumps(out))
            return 2 if "error" in out else 0
        out = generate(stub, req, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()), timeout=args.timeout,
                       api_key=key)
        print()
        if "error" in out:
            e = out["error"]
            print(f"error: {e['code']} {e['reason']}: {e['message']}{_hint(e, key)}", file=sys.stderr)
            return 2
        return 0
