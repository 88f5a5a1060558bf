"""Oversized Secret / ConfigMap policy (validating, pure).

Why: the apiserver holds every object of a LIST in memory while it encodes the
response; 5,000 Secrets of 0.2 MB made each LIST cost ~1 GB and OOMed the
apiservers (the seeds' first incident). Rejecting big objects at admission keeps
that from being built in the first place.

Size is what the object costs in etcd and in a LIST: the keys of ``data`` and
``stringData`` plus decoded ``data`` values (from the base64 length, without
decoding) and ``stringData`` UTF-8 bytes, plus annotation
keys and values when ``countAnnotations`` is on, plus labels, finalizers,
ownerReferences, managedFields and a ``type`` longer than 253 characters always (the
apiserver limits none of them, and keeps the managedFields a client writes). Rules:

* CREATE/UPDATE above the hard limit -> denied with the name, size, limit, fix.
* Above the soft limit -> allowed with a warning.
* UPDATE of an object already over the hard limit that does not grow -> allowed
  with a warning, so teams can shrink what exists and controllers can still
  remove finalizers or change labels on it (the managedFields entry the
  apiserver adds for a new field manager is not growth, up to
  ``oversizedManagedFields``: :func:`does_not_grow`). That rule, not a blanket pass for
  objects being deleted, is what keeps finishing a deletion possible: an object
  with a finalizer nobody removes stays stored (and LISTed) after its DELETE,
  and it must not then grow past the limit.
* DELETE and CONNECT -> always allowed. dryRun -> same answer as a real request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gatekeeper.base.config import parse_size
from gatekeeper.kube.admission import AdmissionRequest, Decision, as_dict, object_label
from gatekeeper.webhook.settings import SecretSettings

FIX = "keep large payloads in a volume or an external secret store"
MAX_PLAIN_TYPE = 253
"""A Secret ``type`` up to a DNS subdomain's length is not counted (every real type is far shorter, and the
limits stay exact for them); a longer one counts in full with labels and other metadata."""


def b64_decoded_len(value: str) -> int:
    """Decoded byte length of a base64 string, from its length and padding only."""
    n = len(value)
    if n == 0:
        return 0
    pad = 2 if value.endswith("==") else (1 if value.endswith("=") else 0)
    return (n * 3) // 4 - pad


def _utf8_len(value: Any) -> int:
    if not isinstance(value, str):
        value = str(value)
    return len(value) if value.isascii() else len(value.encode())


@dataclass(frozen=True)
class Size:
    """An object's counted size, split so the message can say where it comes from."""

    data: int
    annotations: int
    labels: int = 0
    """Labels, finalizers, ownerReferences and managedFields: stored and LISTed like data, and not limited in number
    by the apiserver, so a Secret padded with them must cost what one padded with data costs."""
    managed_fields: int = 0
    """The managedFields part of ``labels`` (the oversized-update rule tells the apiserver's bookkeeping apart)."""

    @property
    def total(self) -> int:
        return self.data + self.annotations + self.labels


def object_size(kind: str, obj: dict[str, Any], count_annotations: bool) -> Size:
    data = as_dict(obj.get("data"))
    total = 0
    # Keys count like values: the apiserver limits a key's length (253) but not how many there are, and 6,000
    # keys of 250 characters with empty values (1.4 MiB stored and LISTed) counted as 0 bytes.
    if kind == "Secret":
        string_data = as_dict(obj.get("stringData"))
        for key, value in string_data.items():
            total += _utf8_len(key) + _utf8_len(value)
        for key, value in data.items():
            if key not in string_data:
                total += _utf8_len(key) + (b64_decoded_len(value) if isinstance(value, str) else 0)
    else:  # ConfigMap: data is plain text, binaryData is base64
        for key, value in data.items():
            total += _utf8_len(key) + _utf8_len(value)
        for key, value in as_dict(obj.get("binaryData")).items():
            total += _utf8_len(key) + (b64_decoded_len(value) if isinstance(value, str) else 0)
    meta = as_dict(obj.get("metadata"))
    ann = 0
    if count_annotations:
        for k, v in as_dict(meta.get("annotations")).items():
            ann += _utf8_len(k) + _utf8_len(v)
    labels = sum(_utf8_len(k) + _utf8_len(v) for k, v in as_dict(meta.get("labels")).items())
    secret_type = obj.get("type")
    if kind == "Secret" and isinstance(secret_type, str) and len(secret_type) > MAX_PLAIN_TYPE:
        labels += _utf8_len(secret_type)  # the apiserver takes a type of any length (5,000 characters were stored)
    # managedFields: the apiserver keeps what a client writes there (any valid field set, of any size): 540 KB of
    # it on a 1-byte Secret was stored and passed the 128 KiB limit. Its own entries add ~100-200 bytes.
    for key in ("finalizers", "ownerReferences"):
        if meta.get(key):
            labels += len(orjson.dumps(meta[key]))
    managed = len(orjson.dumps(meta["managedFields"])) if meta.get("managedFields") else 0
    return Size(total, ann, labels + managed, managed)


def does_not_grow(new: Size, old: Size, managed_fields_allowance: int) -> bool:
    """An UPDATE of an object already over its limit may go through: nothing grows but managedFields, and those
    only up to ``managed_fields_allowance`` bytes in all.

    The apiserver writes a managedFields entry for every new field manager, so "not one byte more" refused a
    controller that relabels or annotates an oversized Secret without making it any larger. The allowance is
    absolute, not per request: clients may write managedFields of any size, and a relative one would let
    repeated updates grow the object without bound."""
    if new.total <= old.total:
        return True
    return (new.total - new.managed_fields <= old.total - old.managed_fields
            and new.managed_fields <= max(old.managed_fields, managed_fields_allowance))


def human(n: int) -> str:
    """212 KiB, 128.5 KiB, 1.2 MiB: exact enough that 'over the limit' is never '128 KiB > 128 KiB'."""
    if n >= 1024 * 1024:
        v, unit = n / (1024 * 1024), "MiB"
    elif n >= 1024:
        v, unit = n / 1024, "KiB"
    else:
        return f"{n} bytes"
    text = f"{v:.1f}".removesuffix(".0")
    return f"{text} {unit}"


def human_pair(size: int, limit: int) -> tuple[str, str]:
    """Both sizes, in bytes when rounding would make a size over the limit print as the limit."""
    a, b = human(size), human(limit)
    return (f"{size} bytes", f"{limit} bytes") if a == b and size != limit else (a, b)


@dataclass(frozen=True)
class Limits:
    hard: int
    soft: int


def limits_for(settings: SecretSettings, kind: str, namespace: str, secret_type: str) -> Limits:
    hard, soft = parse_size(settings.hard_limit), parse_size(settings.soft_limit)
    for o in settings.overrides:
        if o.namespaces and namespace not in o.namespaces:
            continue
        if o.types and (kind != "Secret" or secret_type not in o.types):
            continue
        if o.hard_limit is not None:
            hard = parse_size(o.hard_limit)
        if o.soft_limit is not None:
            soft = parse_size(o.soft_limit)
        break
    return Limits(hard=hard, soft=min(soft, hard))


def handles(req: AdmissionRequest, settings: SecretSettings) -> bool:
    if req.group != "" or req.sub_resource:
        return False
    return (req.kind == "Secret" and settings.enabled) or (req.kind == "ConfigMap" and settings.config_maps)


def review(req: AdmissionRequest, settings: SecretSettings) -> Decision:
    """Decide one Secret/ConfigMap review (callers check :func:`handles` first)."""
    if req.operation not in ("CREATE", "UPDATE") or req.object is None:
        return Decision(outcome="allowed")
    obj = req.object
    meta = as_dict(obj.get("metadata"))
    deleting = req.operation == "UPDATE" and bool(meta.get("deletionTimestamp"))
    secret_type = (obj.get("type") or "Opaque") if req.kind == "Secret" else ""
    limits = limits_for(settings, req.kind, req.namespace, str(secret_type))
    size = object_size(req.kind, obj, settings.count_annotations)
    label = object_label(req.kind, req.namespace, meta)
    parts = [f"{human(n)} of {what}" for n, what in ((size.annotations, "annotations"),
                                                     (size.labels, "labels and other metadata")) if n > 1024]
    where = f" (incl. {', '.join(parts)})" if parts else ""
    audit = {"size-bytes": str(size.total)}
    if deleting and size.total <= limits.hard:
        return Decision(outcome="allowed")  # finishing a deletion: no soft-limit warnings for the controllers doing it
    if size.total > limits.hard:
        if req.operation == "UPDATE" and req.old_object is not None:
            old = object_size(req.kind, req.old_object, settings.count_annotations)
            if old.total > limits.hard and does_not_grow(size, old, parse_size(settings.oversized_managed_fields)):
                audit["oversized-update"] = f"{old.total}->{size.total}"
                return Decision(
                    outcome="warned",
                    warnings=[f"{label} is {human(size.total)}, still over the {human(limits.hard)} limit; "
                              "allowed because it does not grow"],
                    audit=audit,
                )
        audit["denied"] = f"size {size.total} > hard limit {limits.hard}"
        shown, limit = human_pair(size.total, limits.hard)
        return Decision(
            allowed=False,
            outcome="denied",
            message=f"{label} is {shown}{where}, over the {limit} limit: {FIX}",
            audit=audit,
        )
    if size.total > limits.soft:
        return Decision(
            outcome="warned",
            warnings=[f"{label} is {human(size.total)}, over the {human(limits.soft)} soft limit "
                      f"(denied above {human(limits.hard)}); move payloads to a volume"],
            audit=audit,
        )
    return Decision(outcome="allowed")
