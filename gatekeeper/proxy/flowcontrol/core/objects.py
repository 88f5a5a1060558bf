"""FlowSchema and PriorityLevelConfiguration objects in the ``flowcontrol.apiserver.k8s.io/v1`` shape.

Validated as the apiserver does; errors name object and field because a policy file holds many objects.
``metadata`` other than name/uid and ``status`` are ignored so a ``kubectl get -o yaml`` dump loads as-is; unknown
``spec`` keys are errors (as ``--validate=strict``). v1beta3 is accepted: its fields mean the same.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

API_VERSIONS = ("flowcontrol.apiserver.k8s.io/v1", "flowcontrol.apiserver.k8s.io/v1beta3")
MAX_HASH_BITS = 60
"""Shuffle sharding deals the whole hand from one 64-bit hash; upstream caps the entropy at 60 bits."""

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.:]*[a-z0-9])?$")
T = TypeVar("T")


class ObjectError(ValueError):
    """A policy object failed validation; ``str()`` names the object and the field."""

    def __init__(self, obj: str, field: str, message: str) -> None:
        self.obj, self.field, self.message = obj, field, message
        super().__init__(f"{obj}: {field}: {message}" if field else f"{obj}: {message}")


@dataclass(frozen=True)
class Subject:
    """Who a rule applies to: User/Group name or ServiceAccount namespace+name (``*`` = any)."""

    kind: Literal["User", "Group", "ServiceAccount"]
    name: str
    namespace: str = ""


@dataclass(frozen=True)
class ResourceRule:
    """resourceRules[]: matches resource requests by verb, group, resource[/subresource] and namespace."""

    verbs: tuple[str, ...]
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    cluster_scope: bool
    namespaces: tuple[str, ...]


@dataclass(frozen=True)
class NonResourceRule:
    """nonResourceRules[]: matches non-resource URLs (exact, ``/prefix/*`` or ``*``)."""

    verbs: tuple[str, ...]
    urls: tuple[str, ...]


@dataclass(frozen=True)
class PolicyRule:
    """One element of spec.rules: any subject AND (any resource rule OR any non-resource rule)."""

    subjects: tuple[Subject, ...]
    resource_rules: tuple[ResourceRule, ...]
    non_resource_rules: tuple[NonResourceRule, ...]


@dataclass(frozen=True)
class ApfObject:
    """What every validated flowcontrol.apiserver.k8s.io object has: its name and its uid."""

    name: str
    uid: str


@dataclass(frozen=True)
class FlowSchema(ApfObject):
    """A validated FlowSchema."""

    matching_precedence: int
    priority_level: str
    distinguisher: Literal["ByUser", "ByNamespace", ""]
    rules: tuple[PolicyRule, ...]


@dataclass(frozen=True)
class PriorityLevel(ApfObject):
    """A validated PriorityLevelConfiguration."""

    exempt: bool
    nominal_concurrency_shares: int = 30
    reject: bool = False
    """limitResponse.type Reject: no queues, excess requests get 429 at once."""
    queues: int = 64
    hand_size: int = 8
    queue_length_limit: int = 50
    lendable_percent: int = 0
    borrowing_limit_percent: int | None = None


def uid_for(kind: str, name: str) -> str:
    """A stable UID for objects given without one (the 429 headers carry it, as upstream's do)."""
    h = hashlib.sha256(f"gatekeeper/{kind}/{name}".encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class _Reader:
    """Walks one object's mapping, collecting the key path for error messages."""

    def __init__(self, obj: str) -> None:
        self.obj = obj

    def fail(self, path: str, message: str) -> ObjectError:
        return ObjectError(self.obj, path, message)

    def mapping(self, value: Any, path: str, allowed: Iterable[str]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping, got {type(value).__name__}")
        allowed = set(allowed)
        for k in value:
            if k not in allowed:
                raise self.fail(f"{path}.{k}", f"unknown field; expected one of: {', '.join(sorted(allowed))}")
        return value

    def strings(self, value: Any, path: str, *, required: bool = True, wildcard: str | None = None) -> tuple[str, ...]:
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(path, "expected a list of strings")
        if required and not value:
            raise self.fail(path, "must not be empty")
        if wildcard is not None and wildcard in value and len(value) > 1:
            raise self.fail(path, f"if {wildcard!r} is present it must be the only member")
        return tuple(value)

    def integer(self, value: Any, path: str, default: int, lo: int, hi: int | None = None) -> int:
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(path, f"expected an integer, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise self.fail(path, f"must be {rng}, got {value}")
        return value

    def each(self, m: dict[str, Any], key: str, path: str, parse: Callable[[_Reader, Any, str], T]) -> tuple[T, ...]:
        """``parse`` of every element of the list ``m[key]`` (absent: none), each given its own key path."""
        value = m.get(key)
        if value is not None and not isinstance(value, list):
            raise self.fail(f"{path}.{key}", f"expected a list, got {type(value).__name__}")
        return tuple(parse(self, x, f"{path}.{key}[{i}]") for i, x in enumerate(value or ()))

    def string(self, value: Any, path: str) -> str:
        """A required, non-empty string."""
        if value is None or value == "":
            raise self.fail(path, "required field is missing")
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {value!r}")
        return value


def _header(obj: Any, kind: str, index: str) -> tuple[str, str, dict[str, Any]]:
    """Check apiVersion/kind/metadata.name; return (name, uid, spec)."""
    where = f"{kind} {index}".strip()
    if not isinstance(obj, dict):
        raise ObjectError(where, "", f"expected a mapping, got {type(obj).__name__}")
    meta = obj.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        raise ObjectError(where, "metadata.name", "required field is missing")
    label = f"{kind}/{name}"
    if not _NAME.match(name) or len(name) > 253:
        raise ObjectError(label, "metadata.name", "must be a lower-case DNS subdomain name")
    if obj.get("apiVersion") not in API_VERSIONS:
        raise ObjectError(label, "apiVersion", f"expected {API_VERSIONS[0]}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") != kind:
        raise ObjectError(label, "kind", f"expected {kind}, got {obj.get('kind')!r}")
    extra = set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"}
    if extra:
        raise ObjectError(label, sorted(extra)[0], "unknown field; expected apiVersion, kind, metadata, spec")
    raw_uid = meta.get("uid")
    uid = raw_uid if isinstance(raw_uid, str) and raw_uid else uid_for(kind, name)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise ObjectError(label, "spec", "required mapping is missing")
    return name, uid, spec


def _subject(r: _Reader, raw: Any, path: str) -> Subject:
    m = r.mapping(raw, path, ("kind", "user", "group", "serviceAccount"))
    kind = m.get("kind")
    field = {"User": "user", "Group": "group", "ServiceAccount": "serviceAccount"}.get(kind or "")
    if field is None:
        raise r.fail(f"{path}.kind", f"expected one of User, Group, ServiceAccount, got {kind!r}")
    for other in ("user", "group", "serviceAccount"):
        if other != field and m.get(other) is not None:
            raise r.fail(f"{path}.{other}", f"must not be set when kind is {kind}")
    if field == "serviceAccount":
        sa = r.mapping(m.get(field), f"{path}.serviceAccount", ("namespace", "name"))
        ns = r.string(sa.get("namespace"), f"{path}.serviceAccount.namespace")
        name = r.string(sa.get("name"), f"{path}.serviceAccount.name")
        return Subject("ServiceAccount", name, ns)
    sub = r.mapping(m.get(field), f"{path}.{field}", ("name",))
    if not sub:
        raise r.fail(f"{path}.{field}", "required when kind is " + str(kind))
    return Subject(kind, r.string(sub.get("name"), f"{path}.{field}.name"))  # type: ignore[arg-type]


def _resource_rule(r: _Reader, raw: Any, path: str) -> ResourceRule:
    m = r.mapping(raw, path, ("verbs", "apiGroups", "resources", "clusterScope", "namespaces"))
    cluster = m.get("clusterScope", False)
    if not isinstance(cluster, bool):
        raise r.fail(f"{path}.clusterScope", f"expected true or false, got {cluster!r}")
    namespaces = r.strings(m.get("namespaces"), f"{path}.namespaces", required=False, wildcard="*")
    if not cluster and not namespaces:
        raise r.fail(path, "must set clusterScope: true or list namespaces (use ['*'] for every namespace)")
    return ResourceRule(
        verbs=r.strings(m.get("verbs"), f"{path}.verbs", wildcard="*"),
        api_groups=r.strings(m.get("apiGroups"), f"{path}.apiGroups", wildcard="*"),
        resources=r.strings(m.get("resources"), f"{path}.resources", wildcard="*"),
        cluster_scope=cluster,
        namespaces=namespaces,
    )


def _non_resource_rule(r: _Reader, raw: Any, path: str) -> NonResourceRule:
    m = r.mapping(raw, path, ("verbs", "nonResourceURLs"))
    urls = r.strings(m.get("nonResourceURLs"), f"{path}.nonResourceURLs", wildcard="*")
    for i, u in enumerate(urls):
        if u == "*":
            continue
        if not u.startswith("/"):
            raise r.fail(f"{path}.nonResourceURLs[{i}]", f"must start with '/', got {u!r}")
        if "*" in u[:-1] or (u.endswith("*") and not u.endswith("/*")):
            raise r.fail(f"{path}.nonResourceURLs[{i}]", f"'*' is only allowed as a final '/*' segment, got {u!r}")
    return NonResourceRule(verbs=r.strings(m.get("verbs"), f"{path}.verbs", wildcard="*"), urls=urls)


def _policy_rule(r: _Reader, raw: Any, p: str) -> PolicyRule:
    m = r.mapping(raw, p, ("subjects", "resourceRules", "nonResourceRules"))
    subjects = r.each(m, "subjects", p, _subject)
    if not subjects:
        raise r.fail(f"{p}.subjects", "must not be empty")
    rr = r.each(m, "resourceRules", p, _resource_rule)
    nr = r.each(m, "nonResourceRules", p, _non_resource_rule)
    if not rr and not nr:
        raise r.fail(p, "at least one of resourceRules or nonResourceRules is required")
    return PolicyRule(subjects, rr, nr)


def parse_flow_schema(obj: Any, index: str = "") -> FlowSchema:
    """Validate one FlowSchema object (a mapping) and compile it."""
    name, uid, spec = _header(obj, "FlowSchema", index)
    r = _Reader(f"FlowSchema/{name}")
    spec = r.mapping(spec, "spec", ("matchingPrecedence", "priorityLevelConfiguration", "distinguisherMethod", "rules"))
    plc = r.mapping(spec.get("priorityLevelConfiguration"), "spec.priorityLevelConfiguration", ("name",))
    level = r.string(plc.get("name"), "spec.priorityLevelConfiguration.name")
    dm = r.mapping(spec.get("distinguisherMethod"), "spec.distinguisherMethod", ("type",))
    distinguisher = dm.get("type", "") if dm else ""
    if dm and distinguisher not in ("ByUser", "ByNamespace"):
        raise r.fail("spec.distinguisherMethod.type", f"expected ByUser or ByNamespace, got {distinguisher!r}")
    rules = r.each(spec, "rules", "spec", _policy_rule)
    return FlowSchema(
        name=name,
        uid=uid,
        matching_precedence=r.integer(spec.get("matchingPrecedence"), "spec.matchingPrecedence", 1000, 1, 10000),
        priority_level=level,
        distinguisher=distinguisher,  # type: ignore[arg-type]  # checked above
        rules=rules,
    )


def parse_priority_level(obj: Any, index: str = "") -> PriorityLevel:
    """Validate one PriorityLevelConfiguration object (a mapping) and compile it."""
    name, uid, spec = _header(obj, "PriorityLevelConfiguration", index)
    r = _Reader(f"PriorityLevelConfiguration/{name}")
    spec = r.mapping(spec, "spec", ("type", "limited", "exempt"))
    kind = spec.get("type")
    if kind == "Exempt":
        if spec.get("limited") is not None:
            raise r.fail("spec.limited", "must not be set when type is Exempt")
        r.mapping(spec.get("exempt"), "spec.exempt", ("nominalConcurrencyShares", "lendablePercent"))
        return PriorityLevel(name=name, uid=uid, exempt=True, nominal_concurrency_shares=0)
    if kind != "Limited":
        raise r.fail("spec.type", f"expected Limited or Exempt, got {kind!r}")
    if spec.get("exempt") is not None:
        raise r.fail("spec.exempt", "must not be set when type is Limited")
    lim = r.mapping(
        spec.get("limited"),
        "spec.limited",
        (
            "nominalConcurrencyShares",
            "assuredConcurrencyShares",
            "limitResponse",
            "lendablePercent",
            "borrowingLimitPercent",
        ),
    )
    if not lim:
        raise r.fail("spec.limited", "required when type is Limited")
    shares = r.integer(
        lim.get("nominalConcurrencyShares", lim.get("assuredConcurrencyShares")),
        "spec.limited.nominalConcurrencyShares",
        30,
        0,
    )
    lendable = r.integer(lim.get("lendablePercent"), "spec.limited.lendablePercent", 0, 0, 100)
    borrow = lim.get("borrowingLimitPercent")
    borrow = None if borrow is None else r.integer(borrow, "spec.limited.borrowingLimitPercent", 0, 0)
    lr = r.mapping(lim.get("limitResponse"), "spec.limited.limitResponse", ("type", "queuing"))
    lr_type = lr.get("type")
    limited = functools.partial(PriorityLevel, name=name, uid=uid, exempt=False, nominal_concurrency_shares=shares,
                                lendable_percent=lendable, borrowing_limit_percent=borrow)
    if lr_type == "Reject":
        if lr.get("queuing") is not None:
            raise r.fail("spec.limited.limitResponse.queuing", "must not be set when type is Reject")
        return limited(reject=True)
    if lr_type != "Queue":
        raise r.fail("spec.limited.limitResponse.type", f"expected Queue or Reject, got {lr_type!r}")
    qp = "spec.limited.limitResponse.queuing"
    q = r.mapping(lr.get("queuing"), qp, ("queues", "handSize", "queueLengthLimit"))
    queues = r.integer(q.get("queues"), f"{qp}.queues", 64, 1)
    hand = r.integer(q.get("handSize"), f"{qp}.handSize", 8, 1)
    if hand > queues:
        raise r.fail(f"{qp}.handSize", f"must not be greater than queues ({queues}), got {hand}")
    if math.log2(queues) * hand > MAX_HASH_BITS:
        raise r.fail(
            f"{qp}.handSize",
            f"queues={queues} with handSize={hand} needs more than {MAX_HASH_BITS} "
            "bits of entropy (log2(queues) * handSize); lower either",
        )
    return limited(reject=False, queues=queues, hand_size=hand,
                   queue_length_limit=r.integer(q.get("queueLengthLimit"), f"{qp}.queueLengthLimit", 50, 1))
