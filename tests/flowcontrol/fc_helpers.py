"""Small builders for flow-control unit tests: request facts, users and v1 objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gatekeeper.proxy.flowcontrol.core.policy import flow_schema_object

V1 = "flowcontrol.apiserver.k8s.io/v1"


@dataclass
class Req:
    """The RequestInfo digest upstream classification sees."""

    verb: str
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    api_group: str = ""
    path: str = ""
    is_resource_request: bool = True


def nonres(verb: str, path: str) -> Req:
    return Req(verb=verb, path=path, is_resource_request=False)


@dataclass
class User:
    name: str
    groups: list[str] = field(default_factory=list)


def flow_schema(name: str, level: str, rules: list[dict[str, Any]], precedence: int = 1000, by: str = "") -> dict:
    return flow_schema_object(name, precedence, level, rules, by)


def secrets_list_schema(by: str = "", name: str = "secrets-list", level: str = "secrets-list") -> dict:
    """The seeds' FlowSchema shape: LIST of secrets by anyone, precedence 500."""
    return flow_schema(
        name, level, [{"subjects": [group("*")], "resourceRules": [rr(["list"], ["secrets"])]}], 500, by=by
    )


def queued_level(name: str, shares: int, queues: int = 64, hand: int = 8, qlen: int = 50) -> dict:
    return {
        "apiVersion": V1,
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": name},
        "spec": {
            "type": "Limited",
            "limited": {
                "nominalConcurrencyShares": shares,
                "limitResponse": {
                    "type": "Queue",
                    "queuing": {"queues": queues, "handSize": hand, "queueLengthLimit": qlen},
                },
            },
        },
    }


def group(name: str) -> dict:
    return {"kind": "Group", "group": {"name": name}}


def user(name: str) -> dict:
    return {"kind": "User", "user": {"name": name}}


def rr(verbs, resources, groups=("",), namespaces=("*",), cluster=True) -> dict:
    out: dict[str, Any] = {"verbs": list(verbs), "apiGroups": list(groups), "resources": list(resources)}
    if namespaces:
        out["namespaces"] = list(namespaces)
    out["clusterScope"] = cluster
    return out
