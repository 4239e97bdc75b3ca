"""Every overlay's gateway requires API keys from the Secret pdserve-api-keys, mounted read-only, alone and with every
component a user's overlay may add: a gateway that listens on 0.0.0.0 without keys serves every caller as one tenant,
one prefix-cache scope (docs/kubernetes.md, "API keys"). That the pods start and serve with such a Secret, made by
the documented command, is test_launch_from_manifests.py's."""
from __future__ import annotations

import os

import pytest
import yaml

from pdserve.gateway.exposure import is_loopback
from tests.deploy.render import K8S, OVERLAYS, by_kind, containers, flag, render, render_with, workloads

SECRET, SECRET_KEY = "pdserve-api-keys", "keys"


def test_the_overlays_checked_are_every_overlay():
    """Components are listed from their folder below; overlays come from render.OVERLAYS, which a new one must join."""
    assert sorted(os.listdir(os.path.join(K8S, "overlays"))) == sorted(OVERLAYS)


def own_components(overlay: str) -> list[str]:
    with open(os.path.join(K8S, "overlays", overlay, "kustomization.yaml")) as f:
        given = yaml.safe_load(f).get("components", [])
    return sorted(os.path.basename(c) for c in given if os.path.dirname(c).endswith("components"))


def components_to_add(overlay: str) -> list[str]:
    return sorted(set(os.listdir(os.path.join(K8S, "components"))) - set(own_components(overlay)))


@pytest.fixture(scope="module", params=[(o, False) for o in OVERLAYS] + [(o, True) for o in OVERLAYS],
                ids=lambda p: f"{p[0]}{'+components' if p[1] else ''}")
def rendered(request, tmp_path_factory):
    overlay, more = request.param
    if not more:
        return list(render(overlay))
    return render_with(overlay, components_to_add(overlay), tmp_path_factory.mktemp(overlay))


def keys_volume(deployment: dict, container: dict) -> tuple[dict, dict, str]:
    """(the mount, the volume, the file within it) that the container's --api-keys-file names."""
    path = flag(container["args"], "--api-keys-file")
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"--api-keys-file {path} lies under {len(mounts)} mounts: {container['volumeMounts']}"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return mounts[0], volumes[mounts[0]["name"]], path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]


def test_the_gateway_reads_its_keys_from_the_secret_mounted_read_only(rendered):
    gw = by_kind(rendered, "Deployment")["pdserve-gateway"]
    c = containers(gw)[0]
    assert c["args"][0] == "gateway" and not is_loopback(flag(c["args"], "--host"))  # why the keys are needed
    mount, volume, file = keys_volume(gw, c)
    assert mount.get("readOnly") is True and "subPath" not in mount
    assert set(volume) == {"name", "secret"}, volume
    secret = volume["secret"]
    assert secret["secretName"] == SECRET and secret.get("optional", False) is False
    assert {"key": SECRET_KEY, "path": file} in secret["items"]  # the flag's file is the Secret's key `keys`
    mode = next(i for i in secret["items"] if i["path"] == file).get("mode", secret.get("defaultMode", 0o644))
    assert mode & 0o007 == 0, f"the keys file is mode {mode:o}: readable by every user of the node's filesystem"


def test_no_gateway_runs_open_or_with_keys_from_elsewhere(rendered):
    for c in containers(by_kind(rendered, "Deployment")["pdserve-gateway"]):
        assert "--allow-unauthenticated" not in c["args"] and "--api-key" not in c["args"], c["args"]
        assert not any(e["name"] == "PDSERVE_API_KEY" for e in c.get("env", [])), c["env"]


def test_only_the_gateway_container_mounts_the_keys(rendered):
    holders = []
    for w in workloads(rendered):
        names = {v["name"] for v in w["spec"]["template"]["spec"]["volumes"]
                 if v.get("secret", {}).get("secretName") == SECRET}
        holders += [f"{w['metadata']['name']}/{c['name']}" for c in containers(w) + containers(w, init=True)
                    if names & {m["name"] for m in c.get("volumeMounts", [])}]
    assert holders == ["pdserve-gateway/gateway"]
