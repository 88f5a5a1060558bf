"""AdmissionReview v1: types, strict parsing, response builders, JSON Patch helpers.

No I/O here. The webhook's HTTP edge hands us the decoded JSON body; we either
return a typed :class:`AdmissionRequest` or raise :class:`ReviewError`, whose
message is what the HTTP edge sends back with status 400. The apiserver only
ever sends ``admission.k8s.io/v1`` to webhooks that declare
``admissionReviewVersions: [v1]``, so anything else is a client mistake worth a
clear message rather than a guess.

Patches are RFC 6902 JSON Patch; object keys inside a path are escaped per
RFC 6901 (``~`` -> ``~0`` first, then ``/`` -> ``~1``), which is why the GPU
resource appears as ``nvidia.com~1gpu``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

import orjson

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
MAX_WARNING_CHARS = 120
"""kube-apiserver truncates/rejects longer warnings; keep each one short and readable."""


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class GroupVersionResource(TypedDict):
    group: str
    version: str
    resource: str


class UserInfoDict(TypedDict, total=False):
    username: str
    uid: str
    groups: list[str]
    extra: dict[str, list[str]]


class AdmissionRequestDict(TypedDict):
    uid: str
    kind: GroupVersionKind
    resource: GroupVersionResource
    operation: str
    namespace: NotRequired[str]
    name: NotRequired[str]
    subResource: NotRequired[str]
    userInfo: NotRequired[UserInfoDict]
    object: NotRequired[dict[str, Any] | None]
    oldObject: NotRequired[dict[str, Any] | None]
    dryRun: NotRequired[bool]
    options: NotRequired[dict[str, Any] | None]


class StatusDict(TypedDict, total=False):
    code: int
    message: str
    reason: str
    status: str


class AdmissionResponseDict(TypedDict):
    uid: str
    allowed: bool
    status: NotRequired[StatusDict]
    patch: NotRequired[str]
    patchType: NotRequired[Literal["JSONPatch"]]
    warnings: NotRequired[list[str]]
    auditAnnotations: NotRequired[dict[str, str]]


class AdmissionReviewDict(TypedDict):
    apiVersion: str
    kind: str
    request: NotRequired[AdmissionRequestDict]
    response: NotRequired[AdmissionResponseDict]


class PatchOp(TypedDict):
    op: Literal["add", "remove", "replace", "test", "move", "copy"]
    path: str
    value: NotRequired[Any]


class ReviewError(ValueError):
    """The body is not a usable AdmissionReview v1; the message is sent back with HTTP 400."""


@dataclass(frozen=True)
class AdmissionRequest:
    """The parts of ``request`` the policies read, validated and typed."""

    uid: str
    group: str
    version: str
    kind: str
    resource: str
    operation: str
    namespace: str
    name: str
    sub_resource: str
    object: dict[str, Any] | None
    old_object: dict[str, Any] | None
    dry_run: bool
    raw: AdmissionRequestDict


def _need(mapping: dict[str, Any], key: str, where: str, tp: type) -> Any:
    if key not in mapping:
        raise ReviewError(f"{where}.{key} is missing")
    value = mapping[key]
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ReviewError(f"{where}.{key} must be {tp.__name__}, got {type(value).__name__}")
    return value


def _opt(mapping: dict[str, Any], key: str, where: str, tp: type, default: Any) -> Any:
    value = mapping.get(key)
    if value is None:
        return default
    if not isinstance(value, tp):
        raise ReviewError(f"{where}.{key} must be {tp.__name__} or null, got {type(value).__name__}")
    return value


def parse_review(body: bytes | bytearray | memoryview) -> AdmissionRequest:
    """Decode and validate an AdmissionReview v1 body, or raise ReviewError."""
    if not body:
        raise ReviewError("empty request body; expected an AdmissionReview (admission.k8s.io/v1) JSON object")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ReviewError(f"request body is not valid JSON: {exc}") from None
    return review_from_dict(doc)


def review_from_dict(doc: Any) -> AdmissionRequest:
    if not isinstance(doc, dict):
        raise ReviewError("expected an AdmissionReview JSON object")
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if kind != KIND:
        raise ReviewError(f"kind must be {KIND!r}, got {kind!r}")
    if api_version != API_VERSION:
        raise ReviewError(
            f"apiVersion {api_version!r} is not supported; this webhook speaks only {API_VERSION} "
            "(set admissionReviewVersions: [v1] in the webhook configuration)"
        )
    req = doc.get("request")
    if not isinstance(req, dict):
        raise ReviewError("request is missing or not an object")
    uid = _need(req, "uid", "request", str)
    if not uid:
        raise ReviewError("request.uid is empty")
    gvk = _need(req, "kind", "request", dict)
    gvr = _need(req, "resource", "request", dict)
    for part, d in (("group", gvk), ("version", gvk), ("kind", gvk)):
        if not isinstance(d.get(part, ""), str):
            raise ReviewError(f"request.kind.{part} must be a string")
    for part in ("group", "version", "resource"):
        if not isinstance(gvr.get(part, ""), str):
            raise ReviewError(f"request.resource.{part} must be a string")
    operation = _need(req, "operation", "request", str)
    if operation not in OPERATIONS:
        raise ReviewError(f"request.operation must be one of {', '.join(OPERATIONS)}, got {operation!r}")
    obj = _opt(req, "object", "request", dict, None)
    old = _opt(req, "oldObject", "request", dict, None)
    if operation in ("CREATE", "UPDATE") and obj is None:
        raise ReviewError(f"request.object is required for {operation}")
    return AdmissionRequest(
        uid=uid,
        group=gvk.get("group", ""),
        version=gvk.get("version", ""),
        kind=_need(gvk, "kind", "request.kind", str),
        resource=gvr.get("resource", ""),
        operation=operation,
        namespace=_opt(req, "namespace", "request", str, ""),
        name=_opt(req, "name", "request", str, ""),
        sub_resource=_opt(req, "subResource", "request", str, ""),
        object=obj,
        old_object=old,
        dry_run=bool(_opt(req, "dryRun", "request", bool, False)),
        raw=req,  # type: ignore[arg-type]
    )


@dataclass
class Decision:
    """What a policy decided about one request; the HTTP edge turns it into a response."""

    allowed: bool = True
    message: str = ""
    """Denial message (developer-actionable); empty when allowed."""
    code: int = 403
    """HTTP-style status code reported with a denial."""
    reason: str = "Forbidden"
    patch: list[PatchOp] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    audit: dict[str, str] = field(default_factory=dict)
    """auditAnnotations; the apiserver prefixes each key with the webhook name."""
    outcome: str = "allowed"
    """Metrics label: allowed, denied, warned, mutated, skipped."""
    templates: list[dict[str, Any]] = field(default_factory=list)
    """Objects (ResourceClaimTemplates) that must exist before the patched object is usable."""


def as_dict(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one (admission input is untrusted)."""
    return value if isinstance(value, dict) else {}


def short(text: str, limit: int = MAX_WARNING_CHARS) -> str:
    """Trim a warning to the apiserver-friendly length, marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quoted(value: Any, limit: int = 60) -> str:
    """``repr(value)`` trimmed: a denial echoes what the user wrote, and an annotation can be megabytes long
    (its size is validated after mutating admission), which the message and auditAnnotations would carry whole."""
    return short(repr(value), limit)


def response(uid: str, decision: Decision) -> AdmissionReviewDict:
    resp: AdmissionResponseDict = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        resp["status"] = {
            "code": decision.code,
            "reason": decision.reason,
            "message": decision.message,
            "status": "Failure",
        }
    elif decision.patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(orjson.dumps(decision.patch)).decode()
    if decision.warnings:
        resp["warnings"] = [short(w) for w in decision.warnings]
    if decision.audit:
        resp["auditAnnotations"] = dict(decision.audit)
    return {"apiVersion": API_VERSION, "kind": KIND, "response": resp}


def escape(key: str) -> str:
    """RFC 6901: escape one reference token (``~`` first, so ``/`` -> ``~1`` is not re-escaped)."""
    return key.replace("~", "~0").replace("/", "~1")


def pointer(*tokens: str | int) -> str:
    """Build a JSON Pointer from raw tokens, escaping each."""
    return "".join("/" + escape(str(t)) for t in tokens)


def op_add(path: str, value: Any) -> PatchOp:
    return {"op": "add", "path": path, "value": value}


def op_remove(path: str) -> PatchOp:
    return {"op": "remove", "path": path}


def add_map_entry(parent: dict[str, Any] | None, parent_path: str, key: str, value: Any) -> PatchOp:
    """Set ``parent[key]``, creating the map when it is absent (JSON Patch cannot add into nothing)."""
    if parent is None:
        return op_add(parent_path, {key: value})
    return op_add(parent_path + "/" + escape(key), value)


def append_list_items(current: list[Any] | None, list_path: str, items: list[Any]) -> list[PatchOp]:
    """Append items to a list, creating it when absent."""
    if current is None:
        return [op_add(list_path, list(items))]
    return [op_add(list_path + "/-", item) for item in items]


def object_label(kind: str, namespace: str, meta: dict[str, Any] | None) -> str:
    """``secret team-a/model-certs`` (or ``team-a/model-certs-*`` for generateName objects)."""
    meta = meta or {}
    name = meta.get("name") or ""
    if not name and meta.get("generateName"):
        name = f"{meta['generateName']}*"
    name = name or "(unnamed)"
    ns = namespace or meta.get("namespace") or ""
    return f"{kind.lower()} {ns}/{name}" if ns else f"{kind.lower()} {name}"
