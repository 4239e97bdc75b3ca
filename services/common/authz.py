"""Per-method authorisation by the peer's certificate identity (ROLE/NAME in the CN; see tls.py, pki.py).

POLICY says which roles may call which method. FIELDS says, for every field of every broker request and each
role that may send it, whose id the field may carry: the caller's own (by prefix), none, any owner of the
caller's own pool, any (the lease table decides by the leases), or anything (operators). A method missing from
POLICY, and a broker method or request field missing from FIELDS, is refused to everyone: a new RPC or proto
field is closed until someone decides whose ids it may carry.
"""
from __future__ import annotations

import inspect
import logging

import grpc
from prometheus_client import Counter

from .errors import PdError, to_status
from .pki import parse_identity

log = logging.getLogger(__name__)

ANY = frozenset(("broker", "prefill", "decode", "gateway", "operator"))
POLICY: dict[str, frozenset[str]] = {
    "/pdserve.v1.Broker/RegisterPool": frozenset({"decode"}),
    "/pdserve.v1.Broker/ClaimPool": frozenset({"decode"}),
    "/pdserve.v1.Broker/Grant": frozenset({"decode"}),
    "/pdserve.v1.Broker/Extend": frozenset({"decode"}),
    "/pdserve.v1.Broker/Publish": frozenset({"decode"}),
    "/pdserve.v1.Broker/Unpublish": frozenset({"decode"}),
    "/pdserve.v1.Broker/Validate": frozenset({"decode"}),
    "/pdserve.v1.Broker/Release": frozenset({"decode"}),
    "/pdserve.v1.Broker/WatchRevocations": frozenset({"decode"}),
    "/pdserve.v1.Broker/KeepAlive": frozenset({"decode", "prefill"}),
    "/pdserve.v1.Broker/BeginWrite": frozenset({"prefill"}),
    "/pdserve.v1.Broker/EndWrite": frozenset({"prefill"}),
    "/pdserve.v1.Broker/Revoke": frozenset({"operator"}),
    "/pdserve.v1.Broker/GetPoolState": frozenset({"decode", "operator"}),
    "/pdserve.v1.Prefill/Prefill": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Prefill/GetInfo": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Allocate": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Decode": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Run": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Release": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/GetInfo": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Faults/*": frozenset({"operator"}),
    "/grpc.health.v1.Health/*": ANY,
    "/grpc.reflection.v1alpha.ServerReflection/*": ANY,
    "/grpc.reflection.v1.ServerReflection/*": ANY,
}
NO_IDENTITY, BAD_IDENTITY = "NO_PEER_IDENTITY", "BAD_PEER_IDENTITY"
ROLE, RESOURCE, UNLISTED = "ROLE_NOT_ALLOWED", "NOT_OWN_RESOURCE", "METHOD_NOT_IN_POLICY"
FIELD_UNLISTED = "FIELD_NOT_IN_POLICY"
REASONS = (NO_IDENTITY, BAD_IDENTITY, ROLE, RESOURCE, UNLISTED, FIELD_UNLISTED)
DENIALS = Counter("pdserve_auth_denials_total", "Calls refused by mutual-TLS authorisation",
                  ["service", "method", "reason"])


def allowed_roles(method: str) -> frozenset[str] | None:
    """Roles that may call a full method name ('/pkg.Service/Method'); None when it is not in the table."""
    return POLICY.get(method, POLICY.get(method.rsplit("/", 1)[0] + "/*"))


def check_call(method: str, cn: str | None) -> tuple[str, str] | None:
    """None when the peer may call the method at all, else the denial (reason, message)."""
    if not cn:
        return NO_IDENTITY, f"{method}: the peer presented no certificate identity"
    try:
        role, _ = parse_identity(cn)
    except ValueError as e:
        return BAD_IDENTITY, f"{method}: {e}"
    roles = allowed_roles(method)
    if roles is None:
        return UNLISTED, f"{method} is not in the authorisation policy; refused for every caller"
    if role not in roles:
        return ROLE, f"{method} is for {'/'.join(sorted(roles))}, not {cn}"
    return None


# What a field's values may be, per caller role (FIELDS).
OWN = "own"                    # the caller's own ids: each starts with its identity + "/" (pool, writer, holder ids)
OWN_OR_EMPTY = "own or empty"  # the same, or left empty
EMPTY = "empty"                # left empty: this role names nothing there
# owner ids are made by the gateway and carry no prefix: such a field acts only on the owner's leases inside the
# request's pool_id, which must then be the caller's own, so an owner of someone else's pool is out of reach
IN_OWN_POOL = "in own pool"
# a prefill writes into any decode's pool, so these are not the caller's: the lease table acts on them only for an
# owner that holds current leases of exactly the pages named (BeginWrite), or on pages whose active write is this
# writer id's own BeginWrite (EndWrite); knowing a pool's or an owner's id grants nothing
BY_LEASE = "by lease"
ANYTHING = "anything"          # operators act on any pool and owner
NO_ID = "no id"                # counts, epochs, pages, checksums, free text: no pool, holder, writer or owner

BROKER = "/pdserve.v1.Broker/"
_LEASES = {"leases.page": NO_ID, "leases.generation": NO_ID}
# where a pool's bytes live: an address, not an id (the broker cannot tell whose memory it is)
_REGION = {**{f"region.{n}": NO_ID for n in ("transfer_session", "data_base", "tag_base")},
           **{f"region.layout.{n}": NO_ID for n in ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype",
                                                     "page_nbytes", "tag_nbytes")}}
_TERM = {"term_seen": NO_ID}  # the newest election term the caller has seen: an ordered number, no id
FIELDS: dict[str, dict[str, str | dict[str, str]]] = {
    BROKER + "RegisterPool": {**_TERM,
        "pool_id": {"decode": OWN}, "num_pages": NO_ID, "quarantined_pages": NO_ID,
        **_REGION},
    # a decode hands over its own pool only, and the owners it names live in that pool
    BROKER + "ClaimPool": {**_TERM, **_LEASES, "pool_id": {"decode": OWN}, "num_pages": NO_ID, "epoch": NO_ID,
                           "revocations_seen": NO_ID, "owners": {"decode": IN_OWN_POOL}, "num_leases": NO_ID,
                           "cached": NO_ID, **_REGION},
    # chain keys and a scope tag are fingerprints, not ids: they only choose among the cached pages of pool_id,
    # the caller's own pool, whose bytes its decode holds anyway
    BROKER + "Grant": {**_TERM, "pool_id": {"decode": OWN}, "owner": {"decode": IN_OWN_POOL}, "num_pages": NO_ID,
                       "epoch": NO_ID, "prefix_chains": NO_ID, "scope_tag": NO_ID},
    # as Release: a decode publishes and unpublishes pages of its own pool only, and only of owners reading them
    BROKER + "Publish": {"pool_id": {"decode": OWN}, "owner": {"decode": IN_OWN_POOL}, "epoch": NO_ID, **_LEASES,
                         "chains": NO_ID, "checksums": NO_ID, "scope_tag": NO_ID},
    BROKER + "Unpublish": {"pool_id": {"decode": OWN}, "owner": {"decode": IN_OWN_POOL}, "epoch": NO_ID, **_LEASES,
                           "reason": NO_ID},
    BROKER + "Extend": {**_TERM, "pool_id": {"decode": OWN}, "owners": {"decode": IN_OWN_POOL}, "num_pages": NO_ID,
                        "epoch": NO_ID},
    BROKER + "BeginWrite": {**_TERM, "pool_id": {"prefill": BY_LEASE}, "owner": {"prefill": BY_LEASE},
                            "epoch": NO_ID, **_LEASES,
                            "writer_id": {"prefill": OWN}, "max_landing_ms": NO_ID,
                            "writer_ttl_ms": NO_ID},
    BROKER + "EndWrite": {"pool_id": {"prefill": BY_LEASE}, "owner": {"prefill": BY_LEASE}, "epoch": NO_ID,
                          **_LEASES, "writer_id": {"prefill": OWN}, "success": NO_ID, "nothing_posted": NO_ID,
                          **{f"coverage.{n}": NO_ID for n in ("num_tokens", "num_pages", "checksums")},
                          "first_token": NO_ID, "prompt_digest": NO_ID},
    BROKER + "Validate": {**_TERM, "pool_id": {"decode": OWN}, "owner": {"decode": IN_OWN_POOL}, "epoch": NO_ID,
                          **_LEASES, "recheck": NO_ID},
    BROKER + "Release": {"pool_id": {"decode": OWN}, "owner": {"decode": IN_OWN_POOL}, "epoch": NO_ID},
    # the broker's own holders (revoked/..., failed/..., earlier-epoch/...) start with no role: no caller's own;
    # renewing one would keep its pages in quarantine for as long as the caller liked
    BROKER + "KeepAlive": {**_TERM,
        "holder_id": {"decode": OWN, "prefill": OWN}, "ttl_ms": NO_ID,
        # reconciliation revokes pool_id's owners missing from held_owners, and the renewal keeps pool_id from
        # being fenced: both are for the pool's own decode alone. held_owners is not checked against the leases
        # held: an honest decode lists owners whose Grant or Release is still in flight
        "pool_id": {"decode": OWN_OR_EMPTY, "prefill": EMPTY},
        "held_owners": {"decode": IN_OWN_POOL, "prefill": EMPTY},
        "more_holder_ids": {"decode": EMPTY, "prefill": OWN},
        # a cursor: it acknowledges revocations of pool_id's owners only, and only with a pool_id of the caller's
        "revocations_seen": NO_ID},
    BROKER + "WatchRevocations": {**_TERM, "pool_id": {"decode": OWN}, "after_seq": NO_ID, "epoch": NO_ID},
    BROKER + "Revoke": {"pool_id": {"operator": ANYTHING}, "owner": {"operator": ANYTHING}, "reason": NO_ID},
    BROKER + "GetPoolState": {"pool_id": {"decode": OWN, "operator": ANYTHING}},
}


def field_paths(descriptor, prefix: str = "", seen: tuple[str, ...] = ()) -> list[str]:
    """Every leaf field of a message, message fields spelled out ('region.layout.dtype'). A message type that
    contains itself stops at the repeat, whose path no rule names."""
    paths = []
    for f in descriptor.fields:
        if f.message_type is None or f.message_type.full_name in seen:
            paths.append(prefix + f.name)
        else:
            paths += field_paths(f.message_type, f"{prefix}{f.name}.", (*seen, descriptor.full_name))
    return paths


_plans: dict[tuple[str, str, str], list | str] = {}  # (method, message, role) -> checks to run, or why refused
_FREE = (NO_ID, BY_LEASE, ANYTHING)


def _plan(method: str, descriptor, role: str) -> list[tuple[str, str | None, bool]] | str:
    """(field, rule, is repeated) for each field whose rule restricts the role, or the refusal when the request
    has a field no rule names. Worked out once per method, message type and role."""
    key = (method, descriptor.full_name, role)
    if key not in _plans:
        rules = FIELDS.get(method)
        unnamed = [p for p in field_paths(descriptor) if p not in (rules or {})]
        if rules is None:
            _plans[key] = f"{method} has no field rules in the authorisation policy; refused for every caller"
        elif unnamed:
            _plans[key] = (f"{method}: field {', '.join(unnamed)} of {descriptor.full_name} has no rule in the "
                           "authorisation policy; refused for every caller")
        else:
            _plans[key] = [(f, rule, descriptor.fields_by_name[f].is_repeated) for f, by_role in rules.items()
                           if by_role != NO_ID and (rule := by_role.get(role)) not in _FREE]
    return _plans[key]


def check_resource(method: str, cn: str, request) -> tuple[str, str] | None:
    """None when every field of a broker request carries only ids the caller may name (FIELDS), else the denial."""
    if not method.startswith(BROKER):
        return None  # the other services' callers are the gateway and operators, who may name any id
    plan = _plan(method, request.DESCRIPTOR, cn.partition("/")[0])
    if isinstance(plan, str):
        return FIELD_UNLISTED, plan
    for field, rule, is_repeated in plan:
        value = getattr(request, field)
        problem = _problem(rule, cn, field, value if is_repeated else (value,), request)
        if problem is not None:
            return RESOURCE, f"{method}: {cn} {problem}"
    return None


def _problem(rule: str | None, cn: str, field: str, values, request) -> str | None:
    """What is wrong with a field's values under a restricting rule (None: no rule for the caller's role)."""
    mine = cn + "/"
    if rule in (OWN, OWN_OR_EMPTY):
        bad = [v for v in values if not v.startswith(mine) and (v or rule == OWN)]
        return f"may only name a {field} that starts with {mine!r}, not {_show(bad)}" if bad else None
    if rule == EMPTY:
        bad = [v for v in values if v]
        return f"must leave {field} empty (its role names none there), not {_show(bad)}" if bad else None
    if rule == IN_OWN_POOL:
        if not values or request.pool_id.startswith(mine):
            return None
        return (f"may name {field} {_show([v for v in values if v])} only in a pool of its own (a pool_id starting "
                f"with {mine!r}), not in {request.pool_id!r}")
    return f"may not send {field} at all (no rule for its role), not {_show(list(values))}"


def _show(values: list) -> str:
    shown = ", ".join(v.hex() if isinstance(v, bytes) else repr(v) for v in values[:4])
    return shown + (f" and {len(values) - 4} more" if len(values) > 4 else "")


def _peer_cn(context) -> str | None:
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the peer's identity before any handler runs; wraps each method's handler once."""

    def __init__(self, service: str, full_service_names: list[str]):
        self._service = service
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        for method in POLICY:  # every series at 0 from start-up, for the methods this server has
            if method.split("/")[1] in full_service_names and not method.endswith("/*"):
                for reason in REASONS:
                    DENIALS.labels(service, method.rsplit("/", 1)[1], reason)

    async def intercept_service(self, continuation, handler_call_details):
        key = handler_call_details.method
        if key in self._wrapped:
            return self._wrapped[key]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        self._wrapped[key] = wrapped = self._wrap(handler, key)
        return wrapped

    async def _deny_if_needed(self, method: str, request, context) -> None:
        cn = _peer_cn(context)
        denial = check_call(method, cn)
        if denial is None and request is not None:
            denial = check_resource(method, cn, request)
        if denial is None:
            return
        reason, message = denial
        code = grpc.StatusCode.UNAUTHENTICATED if reason in (NO_IDENTITY, BAD_IDENTITY) \
            else grpc.StatusCode.PERMISSION_DENIED
        DENIALS.labels(self._service, method.rsplit("/", 1)[1], reason).inc()
        log.warning("denied %s from %s (%s): %s", method, context.peer(), reason, message)
        await context.abort_with_status(to_status(PdError(code, reason, message)))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deny = self._deny_if_needed
        if handler.unary_unary or handler.stream_unary:
            fn, unary_request = handler.unary_unary or handler.stream_unary, bool(handler.unary_unary)

            async def unary_response(request, context):
                await deny(method, request if unary_request else None, context)
                result = fn(request, context)
                return await result if inspect.isawaitable(result) else result
            make = grpc.unary_unary_rpc_method_handler if unary_request else grpc.stream_unary_rpc_method_handler
            return make(unary_response, handler.request_deserializer, handler.response_serializer)
        fn, unary_request = handler.unary_stream or handler.stream_stream, bool(handler.unary_stream)
        make = grpc.unary_stream_rpc_method_handler if unary_request else grpc.stream_stream_rpc_method_handler
        if inspect.isasyncgenfunction(fn):
            async def stream_response(request, context):
                await deny(method, request if unary_request else None, context)
                async for item in fn(request, context):
                    yield item
        else:  # a handler that writes with context.write() and returns
            async def stream_response(request, context):
                await deny(method, request if unary_request else None, context)
                result = fn(request, context)
                return await result if inspect.isawaitable(result) else result
        return make(stream_response, handler.request_deserializer, handler.response_serializer)
