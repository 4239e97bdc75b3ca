"""Evaluates rendered NetworkPolicies the way the API defines them, so tests can ask "may this pod reach that
port" instead of comparing YAML. Covers what our policies use: podSelector (matchLabels and
matchExpressions In), namespaceSelector matchLabels, numeric and named ports, ingress only."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pod:
    labels: dict
    namespace: str = "pdserve"
    namespace_labels: dict = field(default_factory=dict)
    ports: dict = field(default_factory=dict)  # container port name -> number


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] != "In":
            raise AssertionError(f"netpol evaluator does not know operator {e['operator']}")
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _peer_admits(peer: dict, src: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        raise AssertionError("netpol evaluator does not model ipBlock")
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    ns_ok = selects(ns_sel, {**src.namespace_labels, "kubernetes.io/metadata.name": src.namespace}) \
        if ns_sel is not None else src.namespace == policy_ns
    return ns_ok and (pod_sel is None or selects(pod_sel, src.labels))


def _port_admits(rule_ports, dst: Pod, port: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        assert p.get("protocol", "TCP") == "TCP"
        number = dst.ports.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if number == port or (number is not None and number <= port <= p.get("endPort", number)):
            return True
    return False


def allowed(policies: list[dict], src: Pod, dst: Pod, port: int) -> bool:
    """Ingress to dst:port from src: open unless some policy selects dst, then only what one of them admits."""
    applying = [p for p in policies if p["metadata"].get("namespace", "pdserve") == dst.namespace
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"]["podSelector"], dst.labels)]
    if not applying:
        return True
    for p in applying:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            if (not peers or any(_peer_admits(peer, src, dst.namespace) for peer in peers)) \
                    and _port_admits(rule.get("ports"), dst, port):
                return True
    return False
