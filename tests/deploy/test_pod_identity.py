"""Every pod has an identity of its own (issue 18, hole 3). The broker authorises by the certificate's CN,
ROLE/NAME, and a decode may name only pools that start with its CN + "/" (a prefill: writer ids): if all
pods of a role shared one certificate, any decode pod could watch and release another's pool. So no pod
mounts a Secret (but the gateway's API keys, which hold no certificate and are every replica's by design); each
gets a certificate for its own pod name from cert-manager's csi-driver, and these tests expand the volume
attributes the way the driver does (tests/deploy/csi.py) for two replicas."""
from __future__ import annotations

import copy

import pytest

from pdserve.common.pki import parse_identity
from tests.deploy import csi
from tests.deploy.pods import replica_names
from tests.deploy.render import OVERLAYS, by_kind, containers, flag, render

ROLES = ("broker", "prefill", "decode", "gateway")
NAMESPACE = "pdserve"
# X.509's upper bound on a Common Name (RFC 5280 ub-common-name); cryptography refuses a longer one
MAX_CN = 64
KEYS_SECRET = ("gateway", "pdserve-api-keys")  # (role, Secret): the one shared volume (test_api_keys_secret.py)
# a Deployment's pods are NAME-<pod-template-hash, at most 10>-<5>
POD_SUFFIX = 1 + 10 + 1 + 5


def deployment(overlay: str, role: str) -> dict:
    return by_kind(render(overlay), "Deployment")[f"pdserve-{role}"]


def pod_spec(overlay: str, role: str) -> dict:
    return deployment(overlay, role)["spec"]["template"]["spec"]


def tls_volume(spec: dict) -> dict:
    return next(v for v in spec["volumes"] if v["name"] == "tls")


def request(spec: dict, pod_name: str, volume: dict | None = None) -> csi.Request:
    variables = csi.pod_variables(pod_name, NAMESPACE, "0b6b3c7e-1111-4f4f-9a9a-2c2c2c2c2c2c",
                                  spec["serviceAccountName"])
    return csi.request_for(volume or tls_volume(spec), variables)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_mounts_a_secret(overlay):
    """A Secret is one certificate for every replica: the hole itself."""
    for role in ROLES:
        d = deployment(overlay, role)
        shared = [v["name"] for v in d["spec"]["template"]["spec"]["volumes"] if ("secret" in v or "projected" in v)
                  and (role, v.get("secret", {}).get("secretName")) != KEYS_SECRET]
        assert shared == [], f"pdserve-{role} mounts {shared}: one certificate for every replica"
        for c in containers(d) + containers(d, init=True):
            from_secrets = [e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
            assert from_secrets == [] and not any("secretRef" in e for e in c.get("envFrom", [])), (role, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ("prefill", "decode"))
def test_two_replicas_get_two_identities_from_their_pod_names(overlay, role):
    d = deployment(overlay, role)
    spec = d["spec"]["template"]["spec"]
    assert csi.volume_errors(tls_volume(spec)) == []
    a, b = replica_names(d, 2)
    ra, rb = request(spec, a), request(spec, b)
    assert (ra.common_name, rb.common_name) == (f"{role}/{a}", f"{role}/{b}")
    # the services take each as ROLE/NAME; pool and writer ids then start with two different prefixes
    assert parse_identity(ra.common_name) == (role, a) and parse_identity(rb.common_name) == (role, b)
    assert not (ra.common_name + "/").startswith(rb.common_name + "/")
    assert ra.issuer == rb.issuer == ("cert-manager.io", "Issuer", "pdserve-ca")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_certificate_is_the_one_its_service_and_probes_use(overlay):
    for role in ROLES:
        d = deployment(overlay, role)
        spec, c = d["spec"]["template"]["spec"], containers(d)[0]
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
        req = request(spec, replica_names(d, 1)[0])
        assert req.common_name.partition("/")[0] == role == c["args"][0], (role, req.common_name)
        commands = [c["args"]] + [c[k]["exec"]["command"] for k in ("startupProbe", "readinessProbe", "livenessProbe")
                                  if "--insecure" not in c[k]["exec"]["command"]]
        for words in commands:
            for key in ("cert", "key", "ca"):
                assert flag(words, f"--tls-{key}") == f"{mount}/{req.files[key]}", (role, words)
        # the name clients verify: the probes' --server-name, the gateway's and prefill's pdserve-<role>
        for words in commands[1:]:
            assert flag(words, "--server-name") in req.dns_names and flag(words, "--tls-role") == role
        assert f"pdserve-{role}" in req.dns_names and f"pdserve-{role}.{NAMESPACE}.svc" in req.dns_names
        # one certificate serves and dials (mutual TLS): both extended usages, an ECDSA key like `make-certs`'
        assert {"server auth", "client auth"} <= set(req.usages) and req.key_algorithm == "ECDSA"
        # the driver writes the files 0440 root:<fs-group>: the pod's user reads them only through that group
        assert req.fs_group == spec["securityContext"]["fsGroup"], role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_longest_pod_name_still_fits_a_common_name(overlay):
    for role in ROLES:
        spec = pod_spec(overlay, role)
        longest = f"pdserve-{role}" + "-" + "b" * 10 + "-" + "b" * 5
        assert len(longest) == len(f"pdserve-{role}") + POD_SUFFIX
        cn = request(spec, longest).common_name
        assert len(cn) <= MAX_CN, (cn, len(cn))
        parse_identity(cn)


def test_the_driver_model_refuses_what_the_driver_would():
    """The model these tests rely on is not a rubber stamp: the mistakes a manifest could make are caught."""
    spec = pod_spec("cpu", "decode")
    good = tls_volume(spec)

    def with_attrs(**changes) -> dict:
        v = copy.deepcopy(good)
        attrs = v["csi"]["volumeAttributes"]
        for k, value in changes.items():
            key = csi.PREFIX + k.replace("_", "-")
            if value is None:
                attrs.pop(key)
            else:
                attrs[key] = value
        return v
    writable = copy.deepcopy(good)
    writable["csi"]["readOnly"] = False
    assert any("readOnly" in e for e in csi.volume_errors(writable))
    assert any("issuer-name" in e for e in csi.volume_errors(with_attrs(issuer_name=None)))
    misspelt = copy.deepcopy(good)
    misspelt["csi"]["volumeAttributes"]["csi.cert-manager.io/common_name"] = "decode/${POD_NAME}"
    assert any("common_name" in e for e in csi.volume_errors(misspelt))
    assert any("'server-auth'" in e for e in csi.volume_errors(with_attrs(key_usages="server-auth")))
    with pytest.raises(ValueError, match="POD_IP"):
        request(spec, "pdserve-decode-x", with_attrs(common_name="decode/${POD_IP}"))
    # the kubelet's $(VAR) is not the driver's: it reaches the certificate as it is, and the services refuse it
    kubelet_style = request(spec, "pdserve-decode-x", with_attrs(common_name="decode/$(POD_NAME)"))
    assert kubelet_style.common_name == "decode/$(POD_NAME)"
    with pytest.raises(ValueError, match="is not ROLE/NAME"):
        parse_identity(kubelet_style.common_name)
    # a fixed name is one identity for every replica again: the two-replica test above would see it
    fixed = with_attrs(common_name="decode/pdserve-decode")
    assert request(spec, "pdserve-decode-a", fixed).common_name == request(spec, "pdserve-decode-b", fixed).common_name
