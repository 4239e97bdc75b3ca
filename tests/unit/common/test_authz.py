"""The authorisation table, identity parsing and the resource rule, as plain functions."""
import pytest

from pdserve.common import authz
from pdserve.common.pki import parse_identity
from pdserve.common.proto import broker_pb2 as pb

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
