"""A complete flow-control policy: validated objects, built-in defaults, and classification.

Classification follows upstream APF exactly (``k8s.io/apiserver/pkg/util/flowcontrol``): e.g. ``pods`` does not
match ``pods/log``, a namespace-less request matches only ``clusterScope``, and ``/healthz`` also matches as the
prefix ``/healthz/``. Built-ins (``exempt`` and ``catch-all``) apply unless an object of the same name is given;
the catch-all subject is Group ``*`` so it matches whatever identity the proxy settles on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gatekeeper.kube.requestinfo import RequestInfo
from gatekeeper.proxy.flowcontrol.core.objects import (
    FlowSchema,
    ObjectError,
    PolicyRule,
    PriorityLevel,
    Subject,
    parse_flow_schema,
    parse_priority_level,
)

SA_PREFIX = "system:serviceaccount:"
_V1 = "flowcontrol.apiserver.k8s.io/v1"


class UserFacts(Protocol):
    """The UserInfo fields classification needs."""

    @property
    def name(self) -> str: ...
    @property
    def groups(self) -> list[str]: ...


def _all(values: Sequence[str], wildcard: str, x: str) -> bool:
    return (len(values) == 1 and values[0] == wildcard) or x in values


def subject_matches(s: Subject, user: UserFacts) -> bool:
    if s.kind == "User":
        return s.name == "*" or s.name == user.name
    if s.kind == "Group":
        return s.name == "*" or s.name in user.groups
    if not user.name.startswith(SA_PREFIX):
        return False
    ns, sep, name = user.name[len(SA_PREFIX) :].partition(":")
    return bool(sep) and ns == s.namespace and (s.name == "*" or s.name == name)


def url_matches(rule_urls: Sequence[str], path: str) -> bool:
    for u in rule_urls:
        if u == "*" or u == path:
            return True
        prefix = u[:-1] if u.endswith("*") else u
        if not prefix.endswith("/"):
            prefix += "/"
        if path.startswith(prefix):
            return True
    return False


def rule_matches(rule: PolicyRule, user: UserFacts, ri: RequestInfo) -> bool:
    if not any(subject_matches(s, user) for s in rule.subjects):
        return False
    if ri.is_resource_request:
        res = f"{ri.resource}/{ri.subresource}" if ri.subresource else ri.resource
        for rr in rule.resource_rules:
            if not (
                _all(rr.verbs, "*", ri.verb) and _all(rr.resources, "*", res) and _all(rr.api_groups, "*", ri.api_group)
            ):
                continue
            if rr.cluster_scope if not ri.namespace else _all(rr.namespaces, "*", ri.namespace):
                return True
        return False
    return any(_all(nr.verbs, "*", ri.verb) and url_matches(nr.urls, ri.path) for nr in rule.non_resource_rules)


def schema_matches(fs: FlowSchema, user: UserFacts, ri: RequestInfo) -> bool:
    return any(rule_matches(r, user, ri) for r in fs.rules)


def flow_schema_object(
    name: str, precedence: int, level: str, rules: list[dict[str, Any]], by: str = ""
) -> dict[str, Any]:
    """A v1 FlowSchema mapping, as an operator would write it (the built-ins and tests use it)."""
    spec: dict[str, Any] = {
        "matchingPrecedence": precedence,
        "priorityLevelConfiguration": {"name": level},
        "rules": rules,
    }
    if by:
        spec["distinguisherMethod"] = {"type": by}
    return {"apiVersion": _V1, "kind": "FlowSchema", "metadata": {"name": name}, "spec": spec}


_EVERYTHING = {
    "resourceRules": [
        {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": True, "namespaces": ["*"]}
    ],
    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
}

BUILTIN_OBJECTS: list[dict[str, Any]] = [
    {
        "apiVersion": _V1,
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": "exempt"},
        "spec": {"type": "Exempt"},
    },
    {
        "apiVersion": _V1,
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": "catch-all"},
        "spec": {
            "type": "Limited",
            "limited": {"nominalConcurrencyShares": 5, "limitResponse": {"type": "Reject"}},
        },
    },
    flow_schema_object(
        "exempt",
        1,
        "exempt",
        [{"subjects": [{"kind": "Group", "group": {"name": "system:masters"}}], **_EVERYTHING}],
    ),
    flow_schema_object(
        "probes",
        2,
        "exempt",
        [
            {
                "subjects": [{"kind": "Group", "group": {"name": "*"}}],
                "nonResourceRules": [{"verbs": ["get"], "nonResourceURLs": ["/healthz", "/readyz", "/livez"]}],
            }
        ],
    ),
    flow_schema_object(
        "catch-all",
        10000,
        "catch-all",
        [{"subjects": [{"kind": "Group", "group": {"name": "*"}}], **_EVERYTHING}],
        by="ByUser",
    ),
]
"""Upstream's mandatory objects, adapted: they apply unless an object of the same kind and name is given."""


CLASSIFY_MEMO_SIZE = 4096
"""Distinct (user, request shape) results a Policy remembers; the memo starts over when full."""


@dataclass(frozen=True)
class Policy:
    """Validated, cross-checked objects and the seat limits derived from them."""

    schemas: tuple[FlowSchema, ...]
    """Sorted by (matchingPrecedence, name): classification order."""
    levels: dict[str, PriorityLevel]
    limits: dict[str, int] = field(default_factory=dict)
    """Nominal concurrency limit (seats) per Limited level."""
    memo: dict[tuple[object, ...], tuple[FlowSchema, PriorityLevel]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """classify() results by every input the matching rules read. A reload builds a new Policy,
    so a stale result can never outlive the objects it came from."""

    def classify(self, user: UserFacts, ri: RequestInfo) -> tuple[FlowSchema, PriorityLevel]:
        groups = tuple(user.groups)
        if ri.is_resource_request:
            key: tuple[object, ...] = (
                user.name,
                groups,
                ri.verb,
                ri.api_group,
                ri.resource,
                ri.subresource,
                ri.namespace,
            )
        else:
            key = (user.name, groups, ri.verb, ri.path)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        found = self._match(user, ri)
        if len(self.memo) >= CLASSIFY_MEMO_SIZE:
            self.memo.clear()
        self.memo[key] = found
        return found

    def catch_all(self) -> tuple[FlowSchema, PriorityLevel]:
        """The ``catch-all`` FlowSchema and its level (always present: built in unless replaced)."""
        fs = next((fs for fs in self.schemas if fs.name == "catch-all"), self.schemas[-1])
        return fs, self.levels[fs.priority_level]

    def _match(self, user: UserFacts, ri: RequestInfo) -> tuple[FlowSchema, PriorityLevel]:
        # The last schema is unreachable while the catch-all exists (it always does, built in or replaced).
        fs = next((fs for fs in self.schemas if schema_matches(fs, user, ri)), self.schemas[-1])
        return fs, self.levels[fs.priority_level]


def split_objects(docs: Iterable[Any], source: str) -> list[tuple[str, Any]]:
    """Flatten YAML documents (objects or ``kind: List``) into (label, object) pairs."""
    out: list[tuple[str, Any]] = []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if isinstance(doc, dict) and doc.get("kind") in (
            "List",
            "FlowSchemaList",
            "PriorityLevelConfigurationList",
        ):
            items = doc.get("items") or []
            out.extend((f"{source}[{i}].items[{j}]", item) for j, item in enumerate(items))
        else:
            out.append((f"{source}[{i}]", doc))
    return out


def build_policy(objects: Iterable[tuple[str, Any]], server_concurrency_limit: int) -> Policy:
    """Validate objects (label, mapping), add built-ins, cross-check, and compute nominal limits."""
    schemas: dict[str, FlowSchema] = {}
    levels: dict[str, PriorityLevel] = {}
    for label, obj in objects:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind == "FlowSchema":
            fs = parse_flow_schema(obj, label)
            if fs.name in schemas:
                raise ObjectError(f"FlowSchema/{fs.name}", "metadata.name", "defined twice")
            schemas[fs.name] = fs
        elif kind == "PriorityLevelConfiguration":
            pl = parse_priority_level(obj, label)
            if pl.name in levels:
                raise ObjectError(f"PriorityLevelConfiguration/{pl.name}", "metadata.name", "defined twice")
            levels[pl.name] = pl
        else:
            raise ObjectError(label, "kind", f"expected FlowSchema or PriorityLevelConfiguration, got {kind!r}")
    for obj in BUILTIN_OBJECTS:
        if obj["kind"] == "FlowSchema" and obj["metadata"]["name"] not in schemas:
            schemas[obj["metadata"]["name"]] = parse_flow_schema(obj)
        if obj["kind"] == "PriorityLevelConfiguration" and obj["metadata"]["name"] not in levels:
            levels[obj["metadata"]["name"]] = parse_priority_level(obj)
    for fs in schemas.values():
        if fs.priority_level not in levels:
            raise ObjectError(
                f"FlowSchema/{fs.name}",
                "spec.priorityLevelConfiguration.name",
                f"no PriorityLevelConfiguration named {fs.priority_level!r} (known: {', '.join(sorted(levels))})",
            )
    return Policy(
        schemas=tuple(sorted(schemas.values(), key=lambda s: (s.matching_precedence, s.name))),
        levels=levels,
        limits=nominal_limits(levels.values(), server_concurrency_limit),
    )


def nominal_limits(levels: Iterable[PriorityLevel], total: int) -> dict[str, int]:
    """NominalCL(l) = ceil(total * NCS(l) / sum(NCS over Limited levels)), as upstream computes it."""
    limited = [pl for pl in levels if not pl.exempt]
    shares = sum(pl.nominal_concurrency_shares for pl in limited)
    if shares == 0:
        return {pl.name: 0 for pl in limited}
    return {pl.name: math.ceil(total * pl.nominal_concurrency_shares / shares) for pl in limited}
