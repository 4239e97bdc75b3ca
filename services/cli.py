"""The `pdserve` command: one sub-command per service, plus up, generate, make-model, make-certs and bench."""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile

from . import client
from .common import config
from .common.argparsing import Parser, VersionAction
from .common.cli_args import MODEL_HELP, add_dtype_args, device_arg
from .common.hub import ModelNotFound, resolve_model

SERVICES = ("broker", "prefill", "decode", "gateway")


def _up_extra(args) -> dict[str, list[str]]:
    """The flags `up` passes on to the services it starts (an HTTP API key goes by the environment,
    PDSERVE_API_KEY, which the gateway inherits: a command line is visible to every local user)."""
    engine = ["--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype]
    if args.kv_dtype_alias is not None:  # the deprecated spelling, passed on as given: the services warn
        engine = ["--dtype", args.dtype, "--kv-dtype", args.kv_dtype_alias]
    gateway = ["--byte-tokenizer"] * args.byte_tokenizer + ["--host", args.host] + \
        ["--allow-unauthenticated"] * args.allow_unauthenticated
    if args.http_port is not None:  # else the default port, or an OS-picked one with --free-ports
        gateway += ["--http-port", str(args.http_port)]
    if args.served_model_name:
        gateway += ["--served-model-name", *args.served_model_name]
    out = {"prefill": engine, "decode": engine, "gateway": gateway}
    if args.ha:  # decode stays un-blind through a failover: the standby leads within the ttl, well under max-blind
        out["broker"] = ["--election-ttl", str(HA_ELECTION_TTL)]
        out["decode"] = [*engine, "--max-blind", str(HA_MAX_BLIND)]
    return out


# `up --ha`: a dead leader is replaced within the ttl; decode, blind meanwhile, keeps its running requests as long as
# it hears from the new leader within --max-blind (at most half the broker's lock_delay, 10 s by default)
HA_ELECTION_TTL, HA_MAX_BLIND = 3, 5.0


def _up_devices(args) -> dict[str, list[str]]:
    """Each prefill and decode instance's --device: --prefill-device/--decode-device (one for all instances, or one
    per instance, comma-separated), else --device, else the service's own default."""
    out = {}
    for role, count in (("prefill", args.prefill_instances), ("decode", args.decode_instances)):
        given = getattr(args, f"{role}_device")
        if given is None:
            named = [] if args.device is None else [args.device]
        else:
            named = given.split(",")
            for d in named:
                try:
                    device_arg(d)
                except argparse.ArgumentTypeError as e:
                    raise ValueError(f"--{role}-device {given}: {e}") from None
        if len(named) not in (0, 1, count):
            raise ValueError(f"--{role}-device {given} names {len(named)} devices for {count} {role} instances: "
                             "give one for all of them or one per instance")
        out[role] = named * count if len(named) == 1 else named
    return out


def _up_env(args) -> dict[str, str]:
    """The gateway's API key, by the environment: its command line would show the key to every local user."""
    if args.api_key is None:
        return {}
    if not args.api_key.strip():
        raise ValueError("--api-key is empty")
    return {"PDSERVE_API_KEY": args.api_key}


def _up_stack(args) -> dict:
    """launcher.start_stack's arguments for these `up` flags (but the certificates' folder); ValueError for a flag
    it cannot pass on."""
    return dict(base_ports=not args.free_ports, context_length=args.context_length, page_size=args.page_size,
                prefill_pool_tokens=args.prefill_pool_tokens, decode_pool_tokens=args.decode_pool_tokens,
                allow_small=args.allow_pool_smaller_than_context, num_prefill=args.prefill_instances,
                num_decode=args.decode_instances, extra=_up_extra(args), devices=_up_devices(args),
                gateway_env=_up_env(args), brokers=2 if args.ha else 1)


def _up(args) -> int:
    import signal
    import time

    from . import launcher

    try:
        model = resolve_model(args.model)
        stack = _up_stack(args)
    except ModelNotFound as e:
        hint = f"; or write a random one: `pdserve make-model --out {args.model}`" if args.model == config.DEFAULT_MODEL \
            else ""
        print(f"pdserve up: {e}{hint}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(model.path, "config.json")):
        print(f"pdserve up: no checkpoint at {model.path} (no config.json): run `pdserve make-model --out "
              f"{model.path}`", file=sys.stderr)
        return 1
    etcd = None
    if args.ha:
        from .common.etcd_server import EtcdCluster
        etcd_dir = tempfile.mkdtemp(prefix="pdserve-etcd-")
        etcd = EtcdCluster(etcd_dir, 1)
        print(f"starting etcd ({etcd.endpoints[0]}, data in {etcd_dir}) ...", flush=True)
        etcd.start()
        stack["etcd"] = etcd.endpoints[0]
    print(f"starting {'2 broker replicas' if args.ha else 'broker'}, {args.prefill_instances} prefill, "
          f"{args.decode_instances} decode, gateway ...", flush=True)
    # a throwaway CA per run unless the operator keeps one: the internal services always run mutual TLS
    tls_dir = args.tls_dir or tempfile.mkdtemp(prefix="pdserve-tls-")
    try:
        procs = launcher.start_stack(args.model, echo=True, tls_dir=tls_dir, **stack)
    except BaseException as e:
        if etcd is not None:
            etcd.stop()
            shutil.rmtree(etcd_dir, ignore_errors=True)
        if not args.tls_dir:
            shutil.rmtree(tls_dir, ignore_errors=True)
        if isinstance(e, launcher.StartFailed):  # its output is above; the last line says who refused and why
            code = e.proc.popen.returncode
            print(f"pdserve up: {e.proc.name} {'did not start' if code is None else f'exited with {code}'}: "
                  f"{e.last_line}", file=sys.stderr)
            return 1
        raise
    gw = procs["gateway"][0]
    http = f"OpenAI HTTP {args.host}:{gw.http_port} (model {', '.join(args.served_model_name or [model.name])})" \
        if gw.http_port else "no HTTP API"
    keyed = " (API key required)" if stack["gateway_env"] or os.environ.get("PDSERVE_API_KEY") else ""
    print(f"\npdserve is up: gateway gRPC {args.host}:{gw.port}, {http}{keyed}; try `pdserve generate \"hello\"`. "
          f"Internal services use mutual TLS (certificates in {tls_dir}{'' if args.tls_dir else ', removed at exit'}). "
          "Ctrl-C stops.", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        while not stopping:
            dead = [p for ps in procs.values() for p in ps if not p.alive()]
            for p in dead if args.ha else ():
                if p in procs["broker"]:  # a replica: started again on its ports, as a standby
                    print(f"{p.name} exited with {p.popen.returncode}; starting it again", file=sys.stderr, flush=True)
                    procs["broker"][procs["broker"].index(p)] = launcher.restart(p, echo=True)
                    dead.remove(p)
            if dead:
                print(f"{dead[0].name} exited with {dead[0].popen.returncode}; stopping the stack", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        launcher.stop_stack(procs)
        if etcd is not None:
            etcd.stop()
            shutil.rmtree(etcd_dir, ignore_errors=True)
        if not args.tls_dir:
            shutil.rmtree(tls_dir, ignore_errors=True)
    return 0


def _health(args) -> int:
    """Exit 0 when the service answers SERVING (with --live: answers at all) over mutual TLS: the kubelet's own
    gRPC probe cannot present a client certificate, so the deployment probes with this command."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .common.tls import secure_channel, tls_from_args
    tls = tls_from_args(args, "health", args.tls_role)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else None
    try:
        with secure_channel(f"{args.host}:{args.port}", tls, options, aio=False) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout).status
    except grpc.RpcError as e:
        print(f"health: {args.host}:{args.port}: {e.code().name} {e.details()}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    if args.live:  # liveness: the process answers; NOT_SERVING while it loads its model or drains is alive
        return 0
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def _make_certs(args) -> int:
    from .common.pki import files_for, make_pki
    identities = args.identity or [f"{r}/{r}0" for r in ("broker", "prefill", "decode", "gateway")] + ["operator/local"]
    try:
        make_pki(args.out, identities, tuple(args.dns or ()))
    except ValueError as e:
        print(f"make-certs: {e}", file=sys.stderr)
        return 2
    print(f"CA: {os.path.join(args.out, 'ca.crt')} (its key ca.key signs further identities; keep it private)")
    for identity in identities:
        f = files_for(args.out, identity)
        print(f"{identity}: --tls-cert {f.cert} --tls-key {f.key} --tls-ca {f.ca}")
    return 0


def build_parser(argv: list[str], load_all: bool = False) -> argparse.ArgumentParser:
    """The whole command line; a service's own flags are added only when argv runs it (or load_all: tests)."""
    p = Parser(prog="pdserve", description=__doc__)
    p.add_argument("--version", action=VersionAction, help="print the installed version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in SERVICES:
        sp = sub.add_parser(name, help=f"run one {name} service")
        # only the chosen service is imported: `generate` stays light, and each process builds its own metrics
        if load_all or (argv and argv[0] == name):
            mod = importlib.import_module(f"pdserve.{name}.main")
            mod.add_args(sp)
            sp.set_defaults(fn=mod.main)

    up = sub.add_parser("up", help="run the whole local stack (broker, prefill, decode, gateway)")
    up.add_argument("--model", default=config.DEFAULT_MODEL, help=MODEL_HELP)
    up.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the model's name(s) in the OpenAI API (the gateway's flag; default: --model as given when a "
                         "Hugging Face id, else the checkpoint directory's name)")
    up.add_argument("--host", default="127.0.0.1",
                    help="address the gateway's public gRPC and HTTP APIs bind (0.0.0.0: every interface); the other "
                         "services stay on 127.0.0.1")
    up.add_argument("--http-port", type=int, default=None,
                    help=f"the gateway's OpenAI HTTP port; -1 disables it (default: {config.GATEWAY_HTTP_PORT}, or one "
                         "the OS picks with --free-ports)")
    up.add_argument("--api-key", default=None,
                    help="the key both gateway APIs require (Authorization: Bearer KEY); passed to the gateway by its "
                         "environment, as PDSERVE_API_KEY is (default: $PDSERVE_API_KEY, else no key). A command-line "
                         "key is visible to every local user: prefer the variable")
    up.add_argument("--allow-unauthenticated", action="store_true",
                    help="let the gateway start with no API key on a --host that is not loopback (it refuses to "
                         "otherwise: every caller could generate, and all would share one prefix-cache scope)")
    up.add_argument("--device", type=device_arg, default=None,
                    help="cpu, cuda or cuda:N for every prefill and decode instance (default: the services' own, cuda "
                         "when present)")
    up.add_argument("--prefill-device", default=None, metavar="DEV[,DEV...]",
                    help="the prefill instances' devices: one for all, or one per instance in order (cuda:0,cuda:1)")
    up.add_argument("--decode-device", default=None, metavar="DEV[,DEV...]",
                    help="the decode instances' devices, as --prefill-device")
    up.add_argument("--ha", action="store_true",
                    help="two broker replicas electing a leader on a local etcd (started here, removed at exit): "
                         "a broker killed is replaced within the election ttl and started again, and running "
                         "requests keep running (docs/design.md §3, \"Leader failover\")")
    up.add_argument("--context-length", type=int, default=0)
    up.add_argument("--page-size", type=int, default=config.DEFAULT_PAGE_SIZE)
    up.add_argument("--prefill-pool-tokens", type=int, default=config.DEFAULT_PREFILL_POOL_TOKENS)
    up.add_argument("--decode-pool-tokens", type=int, default=config.DEFAULT_DECODE_POOL_TOKENS)
    up.add_argument("--allow-pool-smaller-than-context", action="store_true")
    up.add_argument("--prefill-instances", type=int, default=1)
    up.add_argument("--decode-instances", type=int, default=1)
    add_dtype_args(up)  # of prefill and decode
    up.add_argument("--byte-tokenizer", action="store_true",
                    help="encode text as UTF-8 bytes (ids 0..255) instead of the checkpoint's tokenizer.json")
    up.add_argument("--free-ports", action="store_true",
                    help="every port picked by the OS instead of the defaults (a second stack on one host, tests)")
    up.add_argument("--tls-dir", default=None,
                    help="keep the run's dev CA and certificates here (default: a temporary folder, removed at exit)")
    up.set_defaults(fn=_up)

    g = sub.add_parser("generate", help="stream one completion from the gateway")
    client.add_arguments(g)
    g.set_defaults(fn=client.main)

    m = sub.add_parser("make-model", help="write a random checkpoint of one model family in Hugging Face format")
    m.add_argument("--out", default=config.DEFAULT_MODEL)
    m.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"],
                   help="model family (its model_type)")
    m.add_argument("--preset", default="tiny", choices=["tiny", "small", "long"],
                   help="tiny (4,096-token context), small (~107M parameters) or long (tiny dimensions, a "
                        "1,048,576-token context, bfloat16)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written tensors (default: the preset's, float32 but for long's bfloat16)")

    def _make(a):
        from .engine.make_model import make_model
        print(make_model(a.out, a.preset, a.seed, a.arch, a.dtype))
        return 0
    m.set_defaults(fn=_make)

    c = sub.add_parser("make-certs", help="write a throwaway dev CA and one mTLS certificate per identity")
    c.add_argument("--out", required=True, help="folder for ca.crt, ca.key and ROLE-NAME.crt/.key (an existing "
                                                "CA there is reused)")
    c.add_argument("--identity", action="append", default=None,
                   help="ROLE/NAME, ROLE one of broker, prefill, decode, gateway, operator (repeatable; default: "
                        "one of each)")
    c.add_argument("--dns", action="append", default=None, help="extra DNS name for every certificate (repeatable)")
    c.set_defaults(fn=_make_certs)

    h = sub.add_parser("health", help="check a service's gRPC health over mutual TLS (exit 0 when SERVING; --live: when it answers)")
    h.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"), help="default: $POD_IP, else 127.0.0.1")
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--server-name", default=None, help="name to verify the server certificate against")
    h.add_argument("--tls-role", default="operator", choices=["broker", "prefill", "decode", "gateway", "operator"],
                   help="role the certificate must have (a pod probes itself with its own certificate)")
    h.add_argument("--timeout", type=float, default=3.0)
    h.add_argument("--live", action="store_true",
                   help="liveness: exit 0 when the service answers health at all (SERVING or NOT_SERVING, e.g. while "
                        "it loads its model or drains); without it, exit 0 only when SERVING (readiness, start-up)")
    from .common.tls import add_tls_args
    add_tls_args(h, "the probe's channel")
    h.set_defaults(fn=_health)

    k = sub.add_parser("check", help="print what each service would do with these flags, and the refusal it would "
                                     "exit with, without allocating anything (exit 1 when any would refuse)")
    if load_all or (argv and argv[0] == "check"):  # as for the services: only when it runs
        from . import check
        k.usage = check.USAGE
        k.description = check.DESCRIPTION
        check.add_args(k)
        k.set_defaults(fn=check.main)

    b = sub.add_parser("bench", help="benchmarks side by side (see bench/)")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(fn=lambda a: __import__("pdserve.bench.run", fromlist=["main"]).main(a))
    return p


def main(argv: list[str] | None = None) -> int:
    from .common.lifeline import watch_from_env
    from .engine.config import CheckpointError
    own_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    # an engine run as its own command (a caller of main(argv) is never executed over), before the lifeline is
    # watched: its fd must outlive the exec
    if own_command_line and args.cmd in ("prefill", "decode"):
        from .engine.allocator import use_jemalloc
        use_jemalloc()
    watch_from_env()  # started by services/launcher.py: stop when it dies
    try:
        rc = args.fn(args)
    except CheckpointError as e:  # a checkpoint the engine cannot serve: the user's to fix, not a crash
        print(f"pdserve {args.cmd}: {e}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
