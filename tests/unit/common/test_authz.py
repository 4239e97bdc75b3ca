"""The authorisation table, identity parsing and the resource rule, as plain functions."""
import pytest

from pdserve.common import authz
from pdserve.common.pki import parse_identity
from pdserve.common.proto import broker_pb2 as pb, common_pb2

BROKER = "/pdserve.v1.Broker/"


@pytest.mark.parametrize("cn,expected", [("decode/d0", ("decode", "d0")), ("operator/alice.ops", ("operator", "alice.ops")),
                                         ("prefill/p-1_x", ("prefill", "p-1_x"))])
def test_parse_identity_accepts_role_and_name(cn, expected):
    assert parse_identity(cn) == expected


@pytest.mark.parametrize("cn", ["decode", "decode/", "root/x", "/d0", "Decode/d0", "decode/d0/extra", "decode/-x",
                                "decode/" + "x" * 64, "decode/a b"])
def test_parse_identity_refuses_malformed(cn):
    with pytest.raises(ValueError, match="ROLE/NAME"):
        parse_identity(cn)


# the table as the issue states it, written out independently of POLICY
EXPECTED = {
    "RegisterPool": {"decode"}, "Grant": {"decode"}, "Validate": {"decode"}, "Release": {"decode"},
    "WatchRevocations": {"decode"}, "KeepAlive": {"decode", "prefill"}, "BeginWrite": {"prefill"},
    "EndWrite": {"prefill"}, "Revoke": {"operator"}, "GetPoolState": {"decode", "operator"},
    "Extend": {"decode"}, "Publish": {"decode"}, "Unpublish": {"decode"},
}


@pytest.mark.parametrize("method", sorted(EXPECTED))
@pytest.mark.parametrize("role", sorted(authz.ANY))
def test_broker_methods_allow_exactly_their_roles(method, role):
    denial = authz.check_call(BROKER + method, f"{role}/x0")
    if role in EXPECTED[method]:
        assert denial is None
    else:
        assert denial[0] == authz.ROLE and role in denial[1] and method in denial[1]


@pytest.mark.parametrize("method", ["/pdserve.v1.Prefill/Prefill", "/pdserve.v1.Prefill/GetInfo",
                                    "/pdserve.v1.Decode/Allocate", "/pdserve.v1.Decode/Decode", "/pdserve.v1.Decode/Run",
                                    "/pdserve.v1.Decode/Release", "/pdserve.v1.Decode/GetInfo"])
def test_engine_methods_are_for_the_gateway_and_operators(method):
    assert {r for r in authz.ANY if authz.check_call(method, f"{r}/n") is None} == {"gateway", "operator"}


def test_faults_only_for_operators_and_health_for_everyone():
    assert {r for r in authz.ANY if authz.check_call("/pdserve.v1.Faults/Arm", f"{r}/n") is None} == {"operator"}
    assert all(authz.check_call("/grpc.health.v1.Health/Check", f"{r}/n") is None for r in authz.ANY)


def test_a_method_missing_from_the_table_is_refused_to_everyone():
    for role in authz.ANY:
        assert authz.check_call(BROKER + "Drain", f"{role}/n")[0] == authz.UNLISTED


def test_no_or_malformed_identity_is_unauthenticated():
    assert authz.check_call(BROKER + "Grant", None)[0] == authz.NO_IDENTITY
    assert authz.check_call(BROKER + "Grant", "")[0] == authz.NO_IDENTITY
    assert authz.check_call("/grpc.health.v1.Health/Check", "nobody")[0] == authz.BAD_IDENTITY


def test_decode_names_only_its_own_pools():
    mine = pb.GrantRequest(pool_id="decode/d0/127.0.0.1-1-2-ab", num_pages=1)
    assert authz.check_resource(BROKER + "Grant", "decode/d0", mine) is None
    for pool in ("decode/d1/127.0.0.1-1-2-ab", "decode/d0", "decode/d00/x", "", "decode/d0x/y"):
        denial = authz.check_resource(BROKER + "Grant", "decode/d0", pb.GrantRequest(pool_id=pool))
        assert denial[0] == authz.RESOURCE and repr(pool) in denial[1]


def test_keepalive_holder_must_be_the_callers_own():
    ka = pb.KeepAliveRequest(holder_id="decode/d0/pool", ttl_ms=1000)
    assert authz.check_resource(BROKER + "KeepAlive", "decode/d0", ka) is None
    assert authz.check_resource(BROKER + "KeepAlive", "prefill/p0", ka)[0] == authz.RESOURCE
    own = pb.KeepAliveRequest(holder_id="prefill/p0/12-ab/00ff", ttl_ms=1)
    assert authz.check_resource(BROKER + "KeepAlive", "prefill/p0", own) is None


def test_prefill_writes_only_under_its_own_writer_ids_but_into_any_pool():
    req = pb.BeginWriteRequest(pool_id="decode/d7/x", writer_id="prefill/p0/1-ab/ff")
    assert authz.check_resource(BROKER + "BeginWrite", "prefill/p0", req) is None
    req.writer_id = "prefill/p1/1-ab/ff"
    assert authz.check_resource(BROKER + "BeginWrite", "prefill/p0", req)[0] == authz.RESOURCE
    end = pb.EndWriteRequest(pool_id="decode/d7/x", writer_id="decode/d7/x/y")
    assert authz.check_resource(BROKER + "EndWrite", "prefill/p0", end)[0] == authz.RESOURCE


def test_operators_and_gateways_name_anything():
    req = pb.RevokeRequest(pool_id="decode/d3/x")
    assert authz.check_resource(BROKER + "Revoke", "operator/o", req) is None
    assert authz.check_resource(BROKER + "GetPoolState", "operator/o", pb.GetPoolStateRequest(pool_id="z")) is None


# --- the field table: every field of every broker request, whose id it may carry -------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["Broker"]
D0, P0 = "decode/d0", "prefill/p0"
POOL = "decode/d0/127.0.0.1-1-2-ab"
# string and bytes fields judged to name no pool, holder, writer or owner: anything added here needs a reason
NOT_IDS = {("RegisterPool", "region.transfer_session"),  # an address; prefill writes only where it was registered
           ("RegisterPool", "region.layout.dtype"), ("EndWrite", "prompt_digest"), ("Revoke", "reason"),
           # the same region, handed over to a new leader by the pool's own decode
           ("ClaimPool", "region.transfer_session"), ("ClaimPool", "region.layout.dtype"),
           # fingerprints: they only choose among the cached pages of the caller's own pool
           ("Grant", "prefix_chains"), ("Grant", "scope_tag"), ("Publish", "chains"), ("Publish", "scope_tag"),
           ("Unpublish", "reason")}


def _leaf_types(descriptor, prefix=""):
    for f in descriptor.fields:
        if f.message_type is None:
            yield prefix + f.name, f
        else:
            yield from _leaf_types(f.message_type, f"{prefix}{f.name}.")


@pytest.mark.parametrize("method", sorted(SERVICE.methods_by_name))
def test_the_table_names_every_field_of_every_broker_request(method):
    rules = authz.FIELDS[BROKER + method]
    leaves = dict(_leaf_types(SERVICE.methods_by_name[method].input_type))
    assert set(leaves) - set(rules) == set(), "fields without a rule"
    assert set(rules) - set(leaves) == set(), "rules of fields the request does not have"
    assert set(authz.field_paths(SERVICE.methods_by_name[method].input_type)) == set(leaves)
    for path, f in leaves.items():
        rule = rules[path]
        if rule == authz.NO_ID:
            is_text = f.type in (f.TYPE_STRING, f.TYPE_BYTES)
            assert not is_text or (method, path) in NOT_IDS, f"{method}.{path} may name someone: give it a rule"
            continue
        # every role the method admits has a rule, no other role has one, and the check reads the field directly
        assert set(rule) == authz.allowed_roles(BROKER + method), (method, path)
        assert "." not in path and f.type in (f.TYPE_STRING, f.TYPE_BYTES), (method, path)
        for role, kind in rule.items():
            if kind in (authz.OWN, authz.OWN_OR_EMPTY):
                assert f.type == f.TYPE_STRING, (method, path)
            if kind == authz.IN_OWN_POOL:  # confined to pool_id only if pool_id itself is the caller's own
                assert rules["pool_id"][role] in (authz.OWN, authz.OWN_OR_EMPTY), (method, path, role)


def test_no_broker_request_field_outside_the_table_gets_through(monkeypatch):
    # a proto field added without a rule: every call of the method is refused until the table names it
    ka = pb.KeepAliveRequest(holder_id="prefill/p0/w", ttl_ms=1000)
    assert authz.check_resource(BROKER + "KeepAlive", P0, ka) is None
    monkeypatch.setitem(authz.FIELDS, BROKER + "KeepAlive",
                        {k: v for k, v in authz.FIELDS[BROKER + "KeepAlive"].items() if k != "more_holder_ids"})
    monkeypatch.setattr(authz, "_plans", {})
    reason, message = authz.check_resource(BROKER + "KeepAlive", P0, ka)
    assert reason == authz.FIELD_UNLISTED and "more_holder_ids" in message and "KeepAliveRequest" in message
    # a request of another shape than the table's, and a broker method with no field rules
    reason, message = authz.check_resource(BROKER + "GetPoolState", "operator/o", pb.GrantRequest(pool_id=POOL))
    assert reason == authz.FIELD_UNLISTED and "owner, num_pages, epoch" in message
    reason, message = authz.check_resource(BROKER + "Drain", "operator/o", pb.WatchRevocationsRequest())
    assert reason == authz.FIELD_UNLISTED and "Drain has no field rules" in message
    assert authz.FIELD_UNLISTED in authz.REASONS  # its denial series exists at 0 from start-up


def test_a_role_the_field_table_does_not_name_is_refused_even_if_the_method_table_let_it_in():
    req = pb.BeginWriteRequest(pool_id=POOL, owner=bytes(16), writer_id="decode/d0/w")
    reason, message = authz.check_resource(BROKER + "BeginWrite", D0, req)
    assert reason == authz.RESOURCE and "may not send pool_id at all" in message and repr(POOL) in message


def test_a_message_that_contains_itself_is_walked_to_the_repeat():
    from google.protobuf import struct_pb2  # Struct -> Value -> Struct, ListValue -> Value
    assert authz.field_paths(struct_pb2.Struct.DESCRIPTOR) == [
        "fields.key", "fields.value.null_value", "fields.value.number_value", "fields.value.string_value",
        "fields.value.bool_value", "fields.value.struct_value", "fields.value.list_value.values"]


# the id-bearing fields and whose ids they carry, written out from the issue independently of FIELDS
OWN, EMPTY, IN_POOL, LEASE_, ANYTHING = "own", "empty", "in own pool", "by lease", "anything"
EXPECTED_IDS = {
    ("RegisterPool", "pool_id"): {"decode": OWN},
    ("ClaimPool", "pool_id"): {"decode": OWN}, ("ClaimPool", "owners"): {"decode": IN_POOL},
    ("Grant", "pool_id"): {"decode": OWN}, ("Grant", "owner"): {"decode": IN_POOL},
    ("Extend", "pool_id"): {"decode": OWN}, ("Extend", "owners"): {"decode": IN_POOL},
    ("Validate", "pool_id"): {"decode": OWN}, ("Validate", "owner"): {"decode": IN_POOL},
    ("Publish", "pool_id"): {"decode": OWN}, ("Publish", "owner"): {"decode": IN_POOL},
    ("Unpublish", "pool_id"): {"decode": OWN}, ("Unpublish", "owner"): {"decode": IN_POOL},
    ("Release", "pool_id"): {"decode": OWN}, ("Release", "owner"): {"decode": IN_POOL},
    ("WatchRevocations", "pool_id"): {"decode": OWN},
    ("GetPoolState", "pool_id"): {"decode": OWN, "operator": ANYTHING},
    ("BeginWrite", "pool_id"): {"prefill": LEASE_}, ("BeginWrite", "owner"): {"prefill": LEASE_},
    ("BeginWrite", "writer_id"): {"prefill": OWN},
    ("EndWrite", "pool_id"): {"prefill": LEASE_}, ("EndWrite", "owner"): {"prefill": LEASE_},
    ("EndWrite", "writer_id"): {"prefill": OWN},
    ("KeepAlive", "holder_id"): {"decode": OWN, "prefill": OWN},
    ("KeepAlive", "more_holder_ids"): {"decode": EMPTY, "prefill": OWN},
    ("KeepAlive", "pool_id"): {"decode": "own or empty", "prefill": EMPTY},
    ("KeepAlive", "held_owners"): {"decode": IN_POOL, "prefill": EMPTY},
    ("Revoke", "pool_id"): {"operator": ANYTHING}, ("Revoke", "owner"): {"operator": ANYTHING},
}


def test_the_id_fields_carry_exactly_the_ids_the_issue_names():
    got = {(m.rsplit("/", 1)[1], f): rule for m, rules in authz.FIELDS.items() for f, rule in rules.items()
           if rule != authz.NO_ID}
    assert got == EXPECTED_IDS


OWNER = bytes(range(16))
LEASE = [common_pb2.PageLease(page=1, generation=3)]
# what the services send (decode/watch.py, servicer.py; prefill/writelease.py): each must still pass. The first
# request of each (method, caller) is also the template of its hostile variants below.
HONEST = [
    ("RegisterPool", D0, pb.RegisterPoolRequest(pool_id=POOL, num_pages=4, region=pb.PoolRegion(
        transfer_session="127.0.0.1:9", data_base=1, tag_base=2))),
    ("Grant", D0, pb.GrantRequest(pool_id=POOL, owner=OWNER, num_pages=2, epoch=5)),
    ("Grant", D0, pb.GrantRequest(pool_id=POOL, owner=OWNER, num_pages=3, epoch=5, prefix_chains=[b"k" * 16] * 2,
                                  scope_tag=b"t" * 8)),
    ("Publish", D0, pb.PublishRequest(pool_id=POOL, owner=OWNER, epoch=5, leases=LEASE, chains=[b"k" * 16],
                                      checksums=[7], scope_tag=b"t" * 8)),
    ("Unpublish", D0, pb.UnpublishRequest(pool_id=POOL, owner=OWNER, epoch=5, leases=LEASE, reason="CHECKSUM")),
    ("Extend", D0, pb.ExtendRequest(pool_id=POOL, epoch=5, owners=[OWNER, b"o" * 16], num_pages=[8, 2])),
    ("Validate", D0, pb.ValidateRequest(pool_id=POOL, owner=OWNER, epoch=5, leases=LEASE)),
    ("Release", D0, pb.ReleaseRequest(pool_id=POOL, owner=OWNER, epoch=5)),
    ("WatchRevocations", D0, pb.WatchRevocationsRequest(pool_id=POOL, after_seq=3, epoch=5)),
    ("GetPoolState", D0, pb.GetPoolStateRequest(pool_id=POOL)),
    ("ClaimPool", D0, pb.ClaimPoolRequest(pool_id=POOL, num_pages=4, epoch=5, term_seen=3, owners=[OWNER],
                                          num_leases=[1], leases=LEASE, cached=[False])),
    ("KeepAlive", D0, pb.KeepAliveRequest(holder_id=POOL, ttl_ms=1000, pool_id=POOL, held_owners=[OWNER, b"o" * 16])),
    ("KeepAlive", D0, pb.KeepAliveRequest(holder_id=POOL, ttl_ms=1000, pool_id=POOL)),  # holds nothing: all revoked
    ("KeepAlive", P0, pb.KeepAliveRequest(holder_id="prefill/p0/9-ab/00", ttl_ms=1000,
                                          more_holder_ids=["prefill/p0/9-ab/01", "prefill/p0/9-ab/02"])),
    ("KeepAlive", P0, pb.KeepAliveRequest(holder_id="prefill/p0/9-ab/startup", ttl_ms=1000)),
    # a prefill writes into any decode's pool: the lease table decides by the leases
    ("BeginWrite", P0, pb.BeginWriteRequest(pool_id="decode/d7/x", owner=OWNER, epoch=5, leases=LEASE,
                                            writer_id="prefill/p0/9-ab/00", max_landing_ms=1, writer_ttl_ms=1)),
    ("EndWrite", P0, pb.EndWriteRequest(pool_id="decode/d7/x", owner=OWNER, epoch=5, leases=LEASE,
                                        writer_id="prefill/p0/9-ab/00", success=True, prompt_digest=b"d" * 32,
                                        coverage=common_pb2.Coverage(num_tokens=3, num_pages=1, checksums=[7]))),
    ("Revoke", "operator/o", pb.RevokeRequest(pool_id="decode/d3/x", owner=OWNER, reason="OPERATOR")),
    ("GetPoolState", "operator/o", pb.GetPoolStateRequest(pool_id="decode/d3/x")),
]


@pytest.mark.parametrize("method,cn,request_", HONEST, ids=[f"{m}-{cn}" for m, cn, _ in HONEST])
def test_what_the_services_send_passes(method, cn, request_):
    assert authz.check_call(BROKER + method, cn) is None
    assert authz.check_resource(BROKER + method, cn, request_) is None


def _foreign(cn: str) -> list[str]:
    """Ids no caller may name as its own: another instance's, a look-alike prefix, the bare identity, none, and the
    broker's own holders (a revoke, a failed write, an earlier epoch), which keep pages in quarantine while renewed."""
    other = "decode/d1" if cn == D0 else "prefill/p1"
    return [f"{other}/9-ab/00", cn + "0/x", cn, "", f"revoked/{POOL}/{OWNER.hex()}", "failed/prefill/p0/9-ab/00",
            f"earlier-epoch/{POOL}"]


def _with(template, field: str, value):
    req = type(template)()
    req.CopyFrom(template)
    if req.DESCRIPTOR.fields_by_name[field].is_repeated:
        getattr(req, field).append(value)
    else:
        setattr(req, field, value)
    return req


def _shown(value) -> str:
    return value.hex() if isinstance(value, bytes) else repr(value)


def _hostile():
    """(method, caller, request, field refused, value shown): each honest template with one field turned hostile."""
    cases, templates = [], {}
    for method, cn, req in HONEST:
        templates.setdefault((method, cn), req)
    for (method, cn), honest in templates.items():
        role = cn.partition("/")[0]
        for (of, field), by_role in EXPECTED_IDS.items():
            if of != method or role not in by_role:
                continue
            rule = by_role[role]
            if rule in (OWN, "own or empty"):
                bad = [v for v in _foreign(cn) if v or rule == OWN]
            elif rule == EMPTY and field == "held_owners":
                bad = [OWNER]
            elif rule == EMPTY:  # even an id of the caller's own: this role names none there
                bad = [v for v in (POOL, "decode/d1/x", cn + "/9-ab/01", *_foreign(cn)) if v]
            elif rule == IN_POOL and field == "held_owners":  # they would reconcile a pool named nowhere
                cases.append((method, cn, _with(honest, "pool_id", ""), field, _shown(honest.held_owners[0])))
                continue
            else:  # an owner acts only in pool_id (its hostile cases are pool_id's), or the lease table decides
                continue
            cases += [(method, cn, _with(honest, field, value), field, _shown(value)) for value in bad]
    return cases


HOSTILE = _hostile()


@pytest.mark.parametrize("method,cn,request_,field,shown", HOSTILE,
                         ids=[f"{m}-{cn}-{f}-{i}" for i, (m, cn, _, f, _) in enumerate(HOSTILE)])
def test_a_field_naming_what_is_not_the_callers_is_refused(method, cn, request_, field, shown):
    assert authz.check_call(BROKER + method, cn) is None
    reason, message = authz.check_resource(BROKER + method, cn, request_)
    assert reason == authz.RESOURCE
    assert f"{BROKER}{method}: {cn} " in message and f" {field} " in message and shown in message, message


def test_every_field_a_caller_may_not_fill_freely_has_hostile_cases():
    covered = {(m, cn.partition("/")[0]) for m, cn, *_ in HOSTILE}
    for (method, field), by_role in EXPECTED_IDS.items():
        for role, rule in by_role.items():
            assert rule in (LEASE_, ANYTHING) or (method, role) in covered, (method, field, role)
    fields = {(m, cn.partition("/")[0], f) for m, cn, _, f, _ in HOSTILE}
    assert {("KeepAlive", "prefill", f) for f in ("pool_id", "held_owners", "more_holder_ids", "holder_id")} <= fields
    assert {("KeepAlive", "decode", f) for f in ("pool_id", "held_owners", "more_holder_ids", "holder_id")} <= fields


def test_long_lists_are_shown_with_a_count():
    req = pb.KeepAliveRequest(holder_id="prefill/p0/w", more_holder_ids=[f"revoked/x/{i}" for i in range(9)])
    message = authz.check_resource(BROKER + "KeepAlive", P0, req)[1]
    assert "'revoked/x/3' and 5 more" in message and "revoked/x/4" not in message


@pytest.mark.parametrize("method", ["Publish", "Unpublish"])
def test_prefix_cache_calls_are_a_decodes_own_pool_only(method):
    """Publish and Unpublish act as Release: another pool's decode, and a prefill or gateway (even naming the pool
    it writes into), are refused, each with the field or the role that refused it."""
    honest = next(req for m, cn, req in HONEST if m == method and cn == D0)
    assert authz.check_call(BROKER + method, "decode/d1") is None  # the method is decode's: the pool decides
    reason, message = authz.check_resource(BROKER + method, "decode/d1", honest)
    assert reason == authz.RESOURCE and repr(POOL) in message and " pool_id " in message
    other = _with(honest, "pool_id", "decode/d1/127.0.0.1-1-2-ab")
    reason, message = authz.check_resource(BROKER + method, D0, other)
    assert reason == authz.RESOURCE and "'decode/d1/127.0.0.1-1-2-ab'" in message and " pool_id " in message
    for cn in (P0, "gateway/g0", "operator/o"):
        reason, message = authz.check_call(BROKER + method, cn)
        assert reason == authz.ROLE and cn in message and method in message
