"""cert-manager's csi-driver (`csi.cert-manager.io`) as the manifests use it, offline: which volume attributes it
reads, how it expands ${POD_NAME} and its siblings, and what certificate a pod's volume asks it for. The facts
come from the driver's source (schemas/cert-manager-csi-driver.json; SOURCE.md says from where).

Stricter than the driver in one way: it ignores an attribute of its own group that it does not know, so a
misspelt `csi.cert-manager.io/common_name` would give a certificate without the pod's identity. Here that
is an error."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from tests.deploy.render import SCHEMAS

with open(os.path.join(SCHEMAS, "cert-manager-csi-driver.json")) as _f:
    DRIVER = json.load(_f)
PREFIX = "csi.cert-manager.io/"
# Go's os.Expand, which the driver calls: $NAME or ${NAME}; a `$` before anything else stays as it is, so a
# kubelet-style $(POD_NAME) reaches the certificate literally
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def expand(text: str, variables: dict[str, str]) -> str:
    """text with the driver's variables filled in; an unknown one is an error, as the driver refuses the volume."""
    unknown = []

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            unknown.append(name)
            return ""
        return variables[name]
    out = _VARIABLE.sub(one, text)
    if unknown:
        raise ValueError(f"undefined variable(s) {unknown} in {text!r}; the driver knows {DRIVER['variables']}")
    return out


def pod_variables(pod_name: str, namespace: str, uid: str, service_account: str) -> dict[str, str]:
    return {"POD_NAME": pod_name, "POD_NAMESPACE": namespace, "POD_UID": uid, "SERVICE_ACCOUNT_NAME": service_account}


@dataclass(frozen=True)
class Request:
    """The certificate one pod's volume asks for, and where the driver writes it."""
    issuer: tuple[str, str, str]  # (group, kind, name)
    common_name: str
    dns_names: tuple[str, ...]
    usages: tuple[str, ...]
    key_algorithm: str
    duration: str
    fs_group: int | None
    files: dict[str, str]  # cert / key / ca -> file name in the volume


def volume_errors(volume: dict) -> list[str]:
    """What the driver would refuse in a pod's `csi:` volume (and the misspellings it would silently ignore)."""
    csi = volume.get("csi")
    name = volume.get("name")
    if csi is None:
        return [f"volume {name} is not a csi volume: {sorted(set(volume) - {'name'})}"]
    errors = []
    if csi.get("driver") != DRIVER["driver"]:
        errors.append(f"volume {name}: driver {csi.get('driver')!r}, not {DRIVER['driver']!r}")
    if csi.get("readOnly") is not DRIVER["read_only"]:
        errors.append(f"volume {name}: readOnly must be true (the driver refuses a writable volume)")
    attrs = csi.get("volumeAttributes", {})
    errors += [f"volume {name}: {k} is required" for k in DRIVER["required"] if not attrs.get(k)]
    errors += [f"volume {name}: unknown attribute {k}" for k in attrs
               if k.startswith(PREFIX) and k not in DRIVER["attributes"]]
    usages = attrs.get(PREFIX + "key-usages", DRIVER["defaults"][PREFIX + "key-usages"])
    errors += [f"volume {name}: unknown key usage {u.strip()!r}" for u in usages.split(",")
               if u.strip() not in DRIVER["key_usages"]]
    algorithm = attrs.get(PREFIX + "key-algorithm", DRIVER["defaults"][PREFIX + "key-algorithm"])
    if algorithm.lower() not in {a.lower() for a in DRIVER["key_algorithms"]}:
        errors.append(f"volume {name}: unknown key algorithm {algorithm!r}")
    if algorithm.lower() == "ecdsa" and attrs.get(PREFIX + "key-encoding", "").lower() == "pkcs1":
        errors.append(f"volume {name}: an ECDSA key cannot be PKCS1-encoded")
    fs_group = attrs.get(PREFIX + "fs-group")
    if fs_group is not None and not (fs_group.isdigit() and 0 < int(fs_group) <= 4294967295):
        errors.append(f"volume {name}: fs-group {fs_group!r} is not a gid in 1-4294967295")
    return errors


def request_for(volume: dict, variables: dict[str, str]) -> Request:
    """The request the driver makes for this volume in a pod with these variables; ValueError if it would not."""
    errors = volume_errors(volume)
    if errors:
        raise ValueError("; ".join(errors))
    attrs = {**DRIVER["defaults"], **volume["csi"].get("volumeAttributes", {})}

    def get(key: str) -> str:
        value = attrs.get(PREFIX + key, "")
        return expand(value, variables) if PREFIX + key in DRIVER["expanded"] else value

    def listed(key: str) -> tuple[str, ...]:
        return tuple(s.strip() for s in get(key).split(",") if s.strip())
    fs_group = get("fs-group")
    return Request(issuer=(get("issuer-group"), get("issuer-kind"), get("issuer-name")),
                   common_name=get("common-name"), dns_names=listed("dns-names"), usages=listed("key-usages"),
                   key_algorithm=get("key-algorithm"), duration=get("duration"),
                   fs_group=int(fs_group) if fs_group else None,
                   files={"cert": get("certificate-file"), "key": get("privatekey-file"), "ca": get("ca-file")})
