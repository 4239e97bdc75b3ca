"""components/ha over the CPU overlay: the broker as replicas electing a leader on a 3-member etcd with client TLS.
Every object validates; no singleton broker is left; a disruption budget keeps one replica (and etcd's quorum);
prefill and decode name every replica by a name its certificate carries; decode's blind bound outlasts a failover
and stays within half the broker's lock_delay; every pdserve command line parses with the real entry point; etcd
demands client certificates, and only brokers reach its client port, only members its peer port."""
from __future__ import annotations

import pytest

from tests.deploy.netpol import Pod, allowed, selects
from tests.deploy.render import K8S_VERSIONS, by_kind, containers, flag, render_with, validate, workloads
from tests.deploy.test_manifest_args import parse

@pytest.fixture(scope="module")
def objs(tmp_path_factory):
    return render_with("cpu", ["ha"], tmp_path_factory.mktemp("ha"))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(objs, version):
    errors = [e for o in objs for e in validate(o, version)]
    assert errors == []


def test_the_broker_is_replicas_with_a_budget_and_etcd_three_members(objs):
    assert "pdserve-broker" not in by_kind(objs, "Deployment")
    sets = by_kind(objs, "StatefulSet")
    broker, etcd = sets["pdserve-broker"], sets["pdserve-etcd"]
    assert broker["spec"]["replicas"] >= 2 and etcd["spec"]["replicas"] == 3
    pdbs = by_kind(objs, "PodDisruptionBudget")
    labels = broker["spec"]["template"]["metadata"]["labels"]
    assert pdbs["pdserve-broker"]["spec"]["maxUnavailable"] == 1
    assert selects(pdbs["pdserve-broker"]["spec"]["selector"], labels)
    assert pdbs["pdserve-etcd"]["spec"]["maxUnavailable"] == 1  # of 3: the quorum stays
    # a standby answers NOT_SERVING: its probes must not restart or exclude it
    c = containers(broker)[0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "--live" in c[probe]["exec"]["command"], probe


def test_clients_name_every_replica_by_a_name_its_certificate_carries(objs):
    broker = by_kind(objs, "StatefulSet")["pdserve-broker"]
    service = broker["spec"]["serviceName"]
    names = [f"pdserve-broker-{i}.{service}:50052" for i in range(broker["spec"]["replicas"])]
    sans = broker["spec"]["template"]["spec"]["volumes"][1]["csi"]["volumeAttributes"]["csi.cert-manager.io/dns-names"]
    assert "${POD_NAME}." + service in sans.split(",")
    headless = by_kind(objs, "Service")[service]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    for name in ("pdserve-prefill", "pdserve-decode"):
        args = containers(by_kind(objs, "Deployment")[name])[0]["args"]
        assert flag(args, "--broker").split(",") == names


def test_decode_outlasts_a_failover_within_its_bound(objs, monkeypatch):
    broker_args = containers(by_kind(objs, "StatefulSet")["pdserve-broker"])[0]["args"]
    decode_args = containers(by_kind(objs, "Deployment")["pdserve-decode"])[0]["args"]
    broker, _ = parse(monkeypatch, [a.replace("$(POD_NAMESPACE)", "pdserve").replace("$(POD_NAME)", "b-0")
                                    for a in broker_args])
    decode, _ = parse(monkeypatch, [a.replace("$(POD_IP)", "10.0.0.9") for a in decode_args])
    assert broker.etcd == "pdserve-etcd:2379" and broker.etcd_ca and broker.etcd_cert and broker.etcd_key
    assert broker.election_ttl < decode.max_blind <= broker.lock_delay / 2


def test_every_command_line_parses(objs, monkeypatch):
    refused = {}
    for w in workloads(objs):
        for c in containers(w) + containers(w, init=True):
            if c["command"] != ["pdserve"]:
                continue
            for argv in [c["args"], *(c[k]["exec"]["command"][1:] for k in ("startupProbe", "readinessProbe",
                                                                              "livenessProbe") if k in c)]:
                argv = [a.replace("$(POD_IP)", "10.0.0.9").replace("$(POD_NAME)", "x-0")
                        .replace("$(POD_NAMESPACE)", "pdserve") for a in argv]
                _, complaint = parse(monkeypatch, argv)
                if complaint:
                    refused[f"{w['metadata']['name']}/{c['name']}"] = complaint
    assert refused == {}


def test_etcd_demands_client_certificates_and_admits_only_brokers_and_members(objs):
    etcd = containers(by_kind(objs, "StatefulSet")["pdserve-etcd"])[0]
    args = etcd["args"]
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    assert flag(args, "--listen-client-urls").startswith("https://")
    assert flag(args, "--listen-peer-urls").startswith("https://")
    policies = by_kind(objs, "NetworkPolicy").values()
    role = {r: Pod({"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": r})
            for r in ("broker", "prefill", "decode", "gateway", "etcd")}
    assert allowed(list(policies), role["broker"], role["etcd"], 2379)
    assert allowed(list(policies), role["etcd"], role["etcd"], 2380)
    for r in ("prefill", "decode", "gateway"):
        assert not allowed(list(policies), role[r], role["etcd"], 2379), r
    assert not allowed(list(policies), role["broker"], role["etcd"], 2380)
