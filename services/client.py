"""`pdserve generate`: streams one completion from the gateway."""
from __future__ import annotations

import json
import sys

import grpc

from .common.errors import from_rpc_error
from .common.proto import common_pb2, gateway_pb2, gateway_pb2_grpc

FINISH_NAMES = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
                common_pb2.FINISH_REASON_UNSPECIFIED: None}


def build_request(prompt: str = "", prompt_token_ids=None, max_tokens: int = 32, temperature: float = 0.0,
                  top_p: float | None = None, seed: int | None = None, ignore_eos: bool = False):
    req = gateway_pb2.GenerateRequest(prompt=prompt, prompt_token_ids=prompt_token_ids or [],
                                      max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)
    if top_p is not None:
        req.top_p = top_p
    if seed is not None:
        req.seed = seed
    return req


def generate(stub, req, on_text=None, timeout: float = 300.0) -> dict:
    """Runs one Generate call; returns the --json result (or its error object)."""
    ids: list[int] = []
    text = []
    finish = None
    prompt_tokens = 0
    try:
        for r in stub.Generate(req, timeout=timeout):
            ids.extend(r.token_ids)
            text.append(r.text)
            prompt_tokens = r.prompt_tokens or prompt_tokens
            if r.finish_reason:
                finish = FINISH_NAMES[r.finish_reason]
            if on_text and r.text:
                on_text(r.text)
    except grpc.RpcError as e:
        err = from_rpc_error(e)
        return {"error": {"code": err.code.name, "reason": err.reason, "message": err.message},
                "token_ids": ids}
    return {"token_ids": ids, "text": "".join(text), "prompt_tokens": prompt_tokens, "finish_reason": finish}


def main(args) -> int:
    ids = [int(x) for x in args.prompt_token_ids.split(",")] if args.prompt_token_ids else None
    req = build_request(args.prompt or "", ids, args.max_tokens, args.temperature, args.top_p, args.seed,
                        args.ignore_eos)
    with grpc.insecure_channel(args.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        if args.json:
            out = generate(stub, req)
            out.pop("token_ids", None) if "error" in out else None
            print(json.dumps(out))
            return 2 if "error" in out else 0
        out = generate(stub, req, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        print()
        if "error" in out:
            e = out["error"]
            print(f"error: {e['code']} {e['reason']}: {e['message']}", file=sys.stderr)
            return 2
        return 0
