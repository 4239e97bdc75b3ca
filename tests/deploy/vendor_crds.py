"""Turns CRD YAMLs (prometheus-operator's, KEDA's) into the JSON Schemas in schemas/ (run by hand when the vendored
version changes; schemas/SOURCE.md records which commit they came from):

    python -m tests.deploy.vendor_crds monitoring.coreos.com_prometheusrules.yaml \
        monitoring.coreos.com_servicemonitors.yaml keda.sh_scaledobjects.yaml

The CRD's openAPIV3Schema is what the API server validates against; two differences from JSON Schema are
bridged here. An API server with strict field validation (kubectl's default) rejects unknown fields, so
every object that lists its properties and does not say x-kubernetes-preserve-unknown-fields gets
additionalProperties: false, which makes a typo in our manifests fail offline as it would on apply.
Descriptions are dropped: they are most of the bytes and validate nothing.
"""
from __future__ import annotations

import json
import os
import sys

import yaml

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")


def to_json_schema(node):
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    # a property may itself be called "description" (a schema, not a string): only the prose goes
    out = {k: to_json_schema(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    pattern = out.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^(?i)"):
        # Go's regexp takes a flag group anywhere; Python's only at the start (same language matched)
        out["pattern"] = "(?i)^" + pattern[len("^(?i)"):]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def convert(crd: dict) -> dict[str, dict]:
    """{file name: schema} for every served version of one CRD, named as kubernetes-validate names its own."""
    kind, group = crd["spec"]["names"]["kind"], crd["spec"]["group"]
    schemas = {}
    for v in crd["spec"]["versions"]:
        schema = to_json_schema(v["schema"]["openAPIV3Schema"])
        # metadata is `type: object` in a CRD; apiVersion and kind must name this CRD
        schema["properties"]["apiVersion"] = {"const": f"{group}/{v['name']}"}
        schema["properties"]["kind"] = {"const": kind}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schemas[f"{kind.lower()}-{group.split('.')[0]}-{v['name']}.json"] = schema
    return schemas


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            crd = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "CustomResourceDefinition")
        for name, schema in convert(crd).items():
            with open(os.path.join(OUT, name), "w") as f:
                json.dump(schema, f, indent=1, sort_keys=True)
                f.write("\n")
            print(f"{path} -> schemas/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
