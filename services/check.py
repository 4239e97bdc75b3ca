"""`pdserve check`: what each service would do with these flags, without allocating anything.

    pdserve check [--lock-delay S] prefill|decode|broker FLAGS...   one service, with exactly its command line
    pdserve check [stack flags]                                        broker, prefill and decode as `up` starts them

It reads config.json only (a checkpoint directory, or the file itself) and prints KV bytes per token, pool tokens
and bytes, the pool/context ratio, the landing bound against the broker's lock_delay, and the line each service
would refuse to start with: the services run the same functions (prefill_plan, decode_plan) at start-up, so the
message is the same. Exit status 1 when any would refuse.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from .common import config
from .common.argparsing import Parser
from .common.cli_args import MODEL_HELP, add_dtype_args
from .common.hub import model_path
from .common.capacity import DTYPE_BYTES, kv_bytes_per_token, pool_capacity, write_unit_refusal
from .engine.config import CheckpointError, ModelConfig
from .engine.sizing import PoolSizeError

SERVICES = ("prefill", "decode", "broker")
USAGE = ("pdserve check [--lock-delay S] {prefill,decode,broker} FLAGS...  (one service, its own command line)\n"
         "       pdserve check [--lock-delay S] [stack flags]  (broker, prefill and decode as `pdserve up` starts them)")
DESCRIPTION = __doc__.split("\n\n")[2].replace("\n", " ")


@dataclass(slots=True)
class Plan:
    """What one service would do: facts to print, and its refusals in the order it checks them (it exits with the
    first)."""
    service: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    max_prompt: int = 0
    max_landing_s: float = 0.0
    landing_terms: str = ""
    bytes_per_token: int = 0  # of the KV pool, in the dtype the service resolves


def read_model_config(model: str) -> ModelConfig:
    """--model names a checkpoint directory, only its config.json, or a Hugging Face id in the local hub cache."""
    path = model_path(model)
    return ModelConfig.from_dir(os.path.dirname(path) if os.path.isfile(path) else path)


def kv_dtype_of(args, cfg: ModelConfig) -> str:
    """The KV pool's dtype as the service resolves it (--kv-cache-dtype or its alias; 'auto': the weights', which
    follow --dtype, else config.json's torch_dtype, else the dtype the tensors are stored in)."""
    from .engine.dtypes import weight_dtype
    requested = args.kv_dtype_alias or args.kv_cache_dtype
    if requested != "auto":
        return requested
    # the tensors' own dtypes are read only when neither the flag nor config.json says
    stored = _file_dtypes(args.model) if args.dtype == "auto" and cfg.torch_dtype is None else set()
    return weight_dtype(args.dtype, cfg.torch_dtype, stored)


def _file_dtypes(model: str) -> set[str]:
    """The dtypes of the checkpoint's tensors (none when only config.json is given)."""
    from .engine.loader import checkpoint_dtypes
    path = model_path(model)
    if os.path.isfile(path):
        return set()
    try:
        return checkpoint_dtypes(path)
    except FileNotFoundError:
        return set()


def _pool_tokens(args, cfg: ModelConfig, kv: str) -> int | None:
    """Tokens the pool holds, sized as the service sizes it (PoolSize); None when the device decides
    (--gpu-memory-utilization)."""
    from .engine.sizing import PoolSize
    if args.gpu_memory_utilization:
        return None
    if not (memory := args.kv_cache_memory):
        return args.pool_tokens // args.page_size * args.page_size
    return PoolSize(memory_bytes=memory).num_pages(cfg, kv, args.page_size, None) * args.page_size


def _engine_plan(service: str, args, cfg: ModelConfig) -> Plan:
    plan = Plan(service)
    kv = kv_dtype_of(args, cfg)
    per_token = plan.bytes_per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                          cfg.head_dim, kv)
    context = args.context_length or cfg.max_position_embeddings
    try:
        pool_tokens = _pool_tokens(args, cfg, kv)
    except PoolSizeError as e:  # the line the service exits with (prefill/main.py, decode/main.py)
        plan.refusals.append(f"{service}: refusing to start: {e}")
        return plan
    plan.facts.append(("KV per token", f"{per_token} bytes ({cfg.num_hidden_layers} layers x 2 x "
                                       f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim} x {DTYPE_BYTES[kv]} bytes "
                                       f"of {kv})"))
    if pool_tokens is None:
        plan.facts.append(("pool", f"--gpu-memory-utilization {args.gpu_memory_utilization}: sized at start-up from "
                                   "the device memory left after the weights; the capacity check runs then"))
        plan.max_prompt = context
        return plan
    plan.facts += [
        ("pool", f"{pool_tokens} tokens = {pool_tokens // args.page_size} pages of {args.page_size}, "
                 f"{pool_tokens * per_token} bytes"),
        ("context", f"{context} tokens; pool/context {pool_tokens / context:.3f}"),
    ]
    cap = pool_capacity(service, pool_tokens, context, args.allow_pool_smaller_than_context)
    plan.max_prompt = cap.max_prompt
    if cap.refusal:
        plan.refusals.append(cap.refusal)
    elif cap.warning:
        plan.facts.append(("admission", cap.warning))
    return plan


def prefill_plan(args, cfg: ModelConfig, lock_delay_ms: int | None = None) -> Plan:
    """Prefill's sizes and refusals; the landing bound's only with lock_delay_ms (the service asks its broker)."""
    from .kvtransfer.engine import landing_bound_s
    from .prefill.writelease import landing_bound_error, landing_terms

    plan = _engine_plan("prefill", args, cfg)
    per_token = plan.bytes_per_token
    if (refusal := write_unit_refusal(args.page_size, per_token, args.max_write_bytes)) is not None:
        plan.refusals.append(refusal)
    plan.max_landing_s = landing_bound_s(args.mooncake_timeout, args.max_write_bytes, args.landing_slack)
    plan.landing_terms = landing_terms(args.mooncake_timeout, args.max_write_bytes, args.landing_slack)
    bound = f"{plan.max_landing_s:.3f}s from a post ({plan.landing_terms})"
    if lock_delay_ms is not None:
        err = landing_bound_error(plan.max_landing_s, lock_delay_ms, plan.landing_terms)
        bound += f" {'>' if err else '<='} broker lock_delay {lock_delay_ms / 1000:.3f}s"
        if err:
            plan.refusals.append(f"prefill: refusing to start: {err}")
    plan.facts += [("write unit", f"{args.max_write_bytes} bytes per batch call (a page is "
                                  f"{args.page_size * per_token})"), ("landing bound", bound)]
    return plan


def decode_plan(args, cfg: ModelConfig, lock_delay_ms: int | None = None) -> Plan:
    from .decode.watch import blind_bound_error

    plan = _engine_plan("decode", args, cfg)
    if lock_delay_ms is not None:
        err = blind_bound_error(args.max_blind, lock_delay_ms)
        plan.facts.append(("blind bound", f"--max-blind {args.max_blind:g}s {'>' if err else '<='} half the "
                                          f"broker lock_delay {lock_delay_ms / 2000:.3f}s"))
        if err:
            plan.refusals.append(f"decode refuses to start: {err}")
    return plan


def broker_plan(args) -> Plan:
    from .broker.main import check_bounds

    plan = Plan("broker", facts=[("lock_delay", f"{args.lock_delay:.3f}s")])
    try:
        check_bounds(args)
    except SystemExit as e:
        plan.refusals.append(str(e))
    return plan


def _unsafe_refusal(service: str, args) -> str | None:
    from .common.unsafe import UnsafeModeRefused, enable_unsafe, modes_in_use
    try:
        enable_unsafe(service, modes_in_use(args), getattr(args, "allow_unsafe", None) or [])
    except UnsafeModeRefused as e:
        return str(e)
    return None


def service_plan(service: str, argv: list[str], lock_delay_s: float) -> Plan:
    """The plan of `pdserve SERVICE ARGV...` against a broker with lock_delay_s (a broker uses its own)."""
    import importlib
    mod = importlib.import_module(f"pdserve.{service}.main")
    p = Parser(prog=f"pdserve check {service}")
    mod.add_args(p)
    args = p.parse_args(argv)
    if service == "broker":
        plan = broker_plan(args)
    else:
        lock_delay_ms = round(lock_delay_s * 1000)
        try:
            cfg = read_model_config(args.model)
        except (CheckpointError, OSError) as e:  # the service prints a CheckpointError so; an OSError is a traceback
            return Plan(service, refusals=[f"pdserve {service}: {e}"])
        plan = (prefill_plan if service == "prefill" else decode_plan)(args, cfg, lock_delay_ms)
    if (refusal := _unsafe_refusal(service, args)) is not None:  # the first check of every service
        plan.refusals.insert(0, refusal)
    return plan


def stack_argv(args) -> dict[str, list[str]]:
    """The flags `pdserve up` would give each service for these stack flags (services/launcher.py)."""
    common = ["--model", args.model, "--page-size", str(args.page_size), "--dtype", args.dtype]
    common += ["--kv-dtype", args.kv_dtype_alias] if args.kv_dtype_alias else ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.context_length:
        common += ["--context-length", str(args.context_length)]
    if args.allow_pool_smaller_than_context:
        common += ["--allow-pool-smaller-than-context"]
    return {"broker": ["--lock-delay", str(args.lock_delay)],
            "prefill": [*common, "--pool-tokens", str(args.prefill_pool_tokens), "--mooncake-timeout",
                        str(args.mooncake_timeout), "--landing-slack", str(args.landing_slack), "--max-write-bytes",
                        str(args.max_write_bytes)],
            "decode": [*common, "--pool-tokens", str(args.decode_pool_tokens), "--max-blind", str(args.max_blind)]}


def add_args(p: argparse.ArgumentParser) -> None:
    from .kvtransfer.engine import DEFAULT_MAX_WRITE_BYTES, MOONCAKE_MIN_TIMEOUT_S
    p.add_argument("--lock-delay", type=float, default=10.0,
                   help="the broker's --lock-delay, which prefill and decode ask their broker for at start-up")
    p.add_argument("--model", default=config.DEFAULT_MODEL, help=f"{MODEL_HELP}; or only a checkpoint's config.json")
    p.add_argument("--context-length", type=int, default=0, help="default: the model's max_position_embeddings")
    p.add_argument("--page-size", type=int, default=config.DEFAULT_PAGE_SIZE)
    p.add_argument("--prefill-pool-tokens", type=int, default=config.DEFAULT_PREFILL_POOL_TOKENS)
    p.add_argument("--decode-pool-tokens", type=int, default=config.DEFAULT_DECODE_POOL_TOKENS)
    p.add_argument("--allow-pool-smaller-than-context", action="store_true")
    add_dtype_args(p)
    p.add_argument("--mooncake-timeout", type=int, default=MOONCAKE_MIN_TIMEOUT_S)
    p.add_argument("--landing-slack", type=float, default=1.0)
    p.add_argument("--max-write-bytes", type=int, default=DEFAULT_MAX_WRITE_BYTES)
    p.add_argument("--max-blind", type=float, default=1.0)
    p.add_argument("service", nargs="?", choices=SERVICES,
                   help="check one service with exactly the flags that follow (its own command line); without it, "
                        "the stack flags above")
    p.add_argument("flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(stack_defaults={f: p.get_default(f) for f in STACK_FLAGS})


def format_plan(plan: Plan) -> list[str]:
    lines = [f"{plan.service}: {'REFUSES to start' if plan.refusals else 'starts'}"]
    lines += [f"  {name + ':':<15}{value}" for name, value in plan.facts]
    if plan.refusals:
        lines.append(f"  exits with:    {plan.refusals[0]}")
        lines += [f"  also:          {r}" for r in plan.refusals[1:]]
    return lines


STACK_FLAGS = ("model", "context_length", "page_size", "prefill_pool_tokens", "decode_pool_tokens",
               "allow_pool_smaller_than_context", "dtype", "kv_cache_dtype", "kv_dtype_alias", "mooncake_timeout",
               "landing_slack", "max_write_bytes",
               "max_blind")


def main(args) -> int:
    if args.service and (given := [f for f in STACK_FLAGS if getattr(args, f) != args.stack_defaults[f]]):
        print(f"check: --{given[0].replace('_', '-')} is a stack flag; with a service, give that service's own flags "
              f"after its name (only --lock-delay goes before it)", file=sys.stderr)
        return 2
    if args.service:
        plans = [service_plan(args.service, args.flags, args.lock_delay)]
    else:
        plans = [service_plan(s, argv, args.lock_delay) for s, argv in stack_argv(args).items()]
    for plan in plans:
        print("\n".join(format_plan(plan)))
    refused = [p.service for p in plans if p.refusals]
    print(f"check: {', '.join(refused)} would refuse to start" if refused else "check: every service would start")
    sys.stdout.flush()
    return 1 if refused else 0
