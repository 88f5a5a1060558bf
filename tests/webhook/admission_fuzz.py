"""Seeded variant generators and oracles for the admission fuzz (pure: no I/O).

The oracles are written from the documentation's words (docs/webhook/), not from the webhook's code, so a bug in the
policy is not repeated in the check that is meant to catch it:

* GPU: a Pod stored in the cluster asks for ``nvidia.com/gpu`` (a count above 0, in any container,
  requests or limits) only where the policy lets whole GPUs through (:func:`whole_gpus_allowed`).
* Size: an object's counted size is what docs/webhook/index.md ("What counts") lists
  (:func:`documented_size`); nothing is stored above the hard limit, and nothing at or under it is denied.

The sandbox test (test_admission_fuzz_sandbox.py) drives these through the real apiserver.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

GPU = "nvidia.com/gpu"
IMAGE = "registry.k8s.io/pause:3.10"
QUANTITIES: list[tuple[Any, int]] = [
    ("1", 1), (1, 1), ("2", 2), (2, 2), ("4", 4), ("1e0", 1), ("1000m", 1), ("2e+0", 2), ("+1", 1), ("01", 1),
    ("1.0", 1), ("10e-1", 1), ("1000000u", 1), (0, 0), ("0", 0),
]
"""Spellings the apiserver accepts for a whole extended-resource count (checked on v1.37.2), with their value."""
LOOKALIKES = ("nvidia.com/GPU", "nvidia.com/gpu-x", "example.com/gpu", "gpu.nvidia.com/gpu")
"""Valid resource names that are not ``nvidia.com/gpu``: the apiserver, scheduler and kubelet compare names
case-sensitively, so none of them is served by the GPU device plugin. (``NVIDIA.com/gpu`` is refused by
validation: an extended resource's prefix must be a lowercase DNS subdomain.)"""
MODES_TRIED = (None, None, None, "off", "dra", "time-slicing", "shared", "mps")


@dataclass(frozen=True)
class NamespacePolicy:
    name: str
    mode: str
    enforced: bool = False
    exempt: bool = False
    """Labelled ``gatekeeper.dev/exempt=true``: never sent to the webhooks."""


EXEMPT = NamespacePolicy("fz-exempt", "dra", exempt=True)
NAMESPACES = [
    NamespacePolicy("fz-dra", "dra", enforced=True),
    NamespacePolicy("fz-ts", "time-slicing", enforced=True),
    NamespacePolicy("fz-shared", "shared", enforced=True),
    NamespacePolicy("fz-open", "dra"),
    EXEMPT,
]
WEBHOOK_CONFIG = """webhook:
  gpu:
    namespaceModes: {fz-dra: dra, fz-ts: time-slicing, fz-shared: shared}
    enforcedNamespaces: [fz-dra, fz-ts, fz-shared]
    namespaceGpuMemory: {fz-shared: 4Gi}
    optOutGroups: [gpu-admins]
"""


def gpu_count(container: dict[str, Any]) -> int:
    """``nvidia.com/gpu`` a stored container asks for (the apiserver keeps limits == requests for it)."""
    res = container.get("resources") or {}
    best = 0
    for key in ("limits", "requests"):
        raw = (res.get(key) or {}).get(GPU)
        if raw is not None:
            best = max(best, quantity_int(raw))
    return best


_SI = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 10**3), "": Fraction(1), "k": Fraction(10**3),
       "M": Fraction(10**6), "G": Fraction(10**9), "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30)}


def quantity_int(raw: Any) -> int:
    """A quantity's value, floored (the fuzz sends whole counts only): ``1``, ``+1``, ``1000000u``, ``1e3``, ``1k``."""
    text = str(raw).strip()
    number = text.rstrip("numkMGKi")
    suffix = text[len(number):]
    exponent = 0
    if "e" in number.lower():
        number, _, exp = number.lower().partition("e")
        exponent = int(exp)
    return int(Fraction(number) * _SI[suffix] * Fraction(10) ** exponent)


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod.get("spec") or {}
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(key) or []]


def asks_whole_gpus(pod: dict[str, Any]) -> bool:
    return any(gpu_count(c) > 0 for c in containers(pod))


REWRITTEN = "gatekeeper.dev/gpu-rewritten"


def has_own_shared(pod: dict[str, Any]) -> bool:
    """Claims or device-plugin sharing names of the pod's own (docs/webhook/gpu-modes.md: such a pod is left as it is,
    except in an enforced namespace, where it is denied; a pod carrying ``gpu-rewritten`` has claims that are ours,
    and is rewritten like any other)."""
    if REWRITTEN in ((pod.get("metadata") or {}).get("annotations") or {}):
        return False
    if (pod.get("spec") or {}).get("resourceClaims"):
        return True
    for c in containers(pod):
        res = c.get("resources") or {}
        if res.get("claims"):
            return True
        for m in (res.get("limits") or {}, res.get("requests") or {}):
            if any(k in ("nvidia.com/gpu.shared", "nvidia.com/gpu.mps") or k.startswith("nvidia.com/mig-") for k in m):
                return True
    return False


def effective_mode(ns: NamespacePolicy, annotation: str | None, opt_out: bool) -> tuple[str, bool]:
    """(mode, forbidden): the documented order (annotation, else the namespace's mode), and in an enforced
    namespace an annotation naming another mode is denied unless the creator is in optOutGroups."""
    if ns.enforced:
        if annotation is None or annotation == ns.mode:
            return ns.mode, False
        return (annotation, False) if opt_out else (ns.mode, True)
    return annotation or ns.mode, False


def whole_gpus_allowed(ns: NamespacePolicy, pod: dict[str, Any], opt_out: bool) -> bool:
    """May this pod be stored still asking for ``nvidia.com/gpu``? (the bypass oracle)."""
    if ns.exempt:
        return True
    annotation = ((pod.get("metadata") or {}).get("annotations") or {}).get("gatekeeper.dev/gpu-mode")
    mode, forbidden = effective_mode(ns, annotation, opt_out)
    if forbidden:
        return False
    if mode == "off":
        return True
    # Where the namespace's mode holds (enforced, no opt-out) own claims beside nvidia.com/gpu are denied;
    # elsewhere, and for an opt-out user who chose a mode (who could as well have chosen off), left as they are.
    return not enforcing(ns, annotation, opt_out) and has_own_shared(pod)


def enforcing(ns: NamespacePolicy, annotation: str | None, opt_out: bool) -> bool:
    """The namespace's enforced mode decides (not an opt-out user's annotation naming another mode)."""
    return ns.enforced and not (opt_out and annotation is not None and annotation != ns.mode)


def expected_denial(ns: NamespacePolicy, pod: dict[str, Any], opt_out: bool) -> str:
    """Why the policy documents a denial of this (otherwise valid) pod, or '' if it must be admitted."""
    if ns.exempt or not asks_whole_gpus(pod):
        return ""
    annotation = ((pod.get("metadata") or {}).get("annotations") or {}).get("gatekeeper.dev/gpu-mode")
    mode, forbidden = effective_mode(ns, annotation, opt_out)
    if forbidden:
        return "annotation names another mode in an enforced namespace"
    if mode == "off":
        return ""
    if has_own_shared(pod):
        enforced = enforcing(ns, annotation, opt_out)
        return "own claims or shared GPUs beside nvidia.com/gpu in an enforced namespace" if enforced else ""
    if mode == "mps" and any(gpu_count(c) > 1 for c in containers(pod)):
        return "mps share above 1"
    return ""


@dataclass
class PodCase:
    index: int
    pod: dict[str, Any]
    namespace: NamespacePolicy
    opt_out: bool
    route: str
    """``create``, ``dry-run``, ``apply`` (server-side apply creating it) or ``apply-dry-run``."""
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"case {self.index} route={self.route} ns={self.namespace.name} opt_out={self.opt_out} "
                f"{' '.join(self.notes)} pod={json.dumps(self.pod, separators=(',', ':'))}")


def _resources(rng: random.Random, notes: list[str], where: str) -> dict[str, Any]:
    pick = rng.random()
    res: dict[str, Any] = {}
    if pick < 0.25:
        return res
    name = GPU
    if pick > 0.93:
        name = rng.choice(LOOKALIKES)
    raw, _ = rng.choice(QUANTITIES)
    placement = rng.choice(("limits", "requests", "both", "limits"))
    if placement in ("limits", "both"):
        res["limits"] = {name: raw}
    if placement in ("requests", "both"):
        res["requests"] = {name: raw}
    if rng.random() < 0.2:
        res.setdefault("limits", {})["cpu"] = "100m"
    if rng.random() < 0.06:
        res.setdefault("limits", {})["nvidia.com/gpu.shared"] = "1"
        notes.append(f"{where}:own-shared")
    notes.append(f"{where}:{name}={raw!r}@{placement}")
    return res


def pod_cases(seed: int, count: int, namespaces: list[NamespacePolicy]) -> list[PodCase]:
    """``count`` Pod variants from ``seed``: GPUs in app, init and sidecar containers, requests/limits/both,
    every accepted quantity spelling, lookalike names, modes by annotation, opt-out identity, four routes."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        notes: list[str] = []
        long_names = rng.random() < 0.1  # 63 characters: the claim name gpu-<container> must be shortened
        spec: dict[str, Any] = {"containers": [
            {"name": (f"app{j}-" + "n" * 58)[:63] if long_names else f"app{j}", "image": IMAGE,
             "resources": _resources(rng, notes, f"app{j}")}
            for j in range(rng.choice((1, 1, 2, 3)))]}
        if rng.random() < 0.08:  # a DRA claim of the pod's own, on its first container
            spec["resourceClaims"] = [{"name": "mine", "resourceClaimTemplateName": "users-own"}]
            spec["containers"][0]["resources"]["claims"] = [{"name": "mine"}]
            notes.append("own-claim")
        inits = []
        if rng.random() < 0.35:
            inits.append({"name": "init0", "image": IMAGE, "resources": _resources(rng, notes, "init0")})
        if rng.random() < 0.35:
            inits.append({"name": "side0", "image": IMAGE, "restartPolicy": "Always",
                          "resources": _resources(rng, notes, "side0")})
        if inits:
            spec["initContainers"] = inits
        annotations = {}
        mode = rng.choice(MODES_TRIED)
        if mode is not None:
            annotations["gatekeeper.dev/gpu-mode"] = mode
        if mode == "shared" or rng.random() < 0.2:
            annotations["gatekeeper.dev/gpu-memory"] = rng.choice(("4Gi", "10G", "512Mi"))
        if rng.random() < 0.06:  # forged: says the pod's claims are gatekeeper's own
            annotations[REWRITTEN] = "dra app0:1->gpu-app0"
            notes.append("forged-rewritten")
        ns = rng.choice(namespaces)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"fz-{seed}-{i}", "annotations": annotations, "labels": {"fuzz-case": str(i)}},
               "spec": spec}
        out.append(PodCase(i, pod, ns, opt_out=rng.random() < 0.25,
                           route=rng.choice(("create", "create", "dry-run", "apply", "apply-dry-run")), notes=notes))
    return out


# --- sizes ---------------------------------------------------------------------------------------------------

def _b64_len(value: str) -> int:
    return len(base64.b64decode(value)) if value else 0


def _json_len(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def documented_size(obj: dict[str, Any]) -> int:
    """The documented counted size of a stored Secret or ConfigMap (countAnnotations on, the default).

    Keys and decoded values of ``data`` (Secret; ``stringData`` is merged into ``data`` by the apiserver),
    ``data`` and decoded ``binaryData`` (ConfigMap), annotations, labels, finalizers, ownerReferences,
    managedFields (their JSON) and a Secret ``type`` longer than 253 characters.
    """
    kind = obj.get("kind")
    total = 0
    for k, v in (obj.get("data") or {}).items():
        total += len(k.encode()) + (_b64_len(v) if kind == "Secret" else len(v.encode()))
    for k, v in (obj.get("binaryData") or {}).items():
        total += len(k.encode()) + _b64_len(v)
    meta = obj.get("metadata") or {}
    for key in ("annotations", "labels"):
        total += sum(len(k.encode()) + len(v.encode()) for k, v in (meta.get(key) or {}).items())
    for key in ("finalizers", "ownerReferences", "managedFields"):
        if meta.get(key):
            total += _json_len(meta[key])
    secret_type = obj.get("type")
    if kind == "Secret" and isinstance(secret_type, str) and len(secret_type) > 253:
        total += len(secret_type.encode())
    return total


SIZE_ROUTES = ("create", "dry-run", "apply", "put", "json-patch", "merge-patch", "strategic-patch", "apply-update")
SIZE_LAYOUTS = ("one-key", "many-keys", "string-data", "data-and-string-data", "binary", "labels", "annotations",
                "immutable", "finalizers", "long-type")
SECRET_ONLY = ("string-data", "data-and-string-data", "long-type")


@dataclass
class SizeCase:
    index: int
    kind: str
    """Secret or ConfigMap."""
    route: str
    layout: str
    target: int
    """Counted size the case aims at (the pad is calibrated against the apiserver to hit it exactly)."""
    name: str

    def describe(self) -> str:
        return f"case {self.index} {self.kind} route={self.route} layout={self.layout} target={self.target}"


def size_cases(seed: int, count: int, hard: int) -> list[SizeCase]:
    """Targets cluster at the hard limit (one under, at, one over) and spread below and above it."""
    rng = random.Random(seed)
    targets = (1024, hard // 2, hard - 1, hard, hard + 1, hard + 1, hard + 4096, hard * 2)
    out = []
    for i in range(count):
        kind = "ConfigMap" if rng.random() < 0.25 else "Secret"
        layouts = [x for x in SIZE_LAYOUTS if kind == "Secret" or x not in SECRET_ONLY]
        out.append(SizeCase(i, kind, rng.choice(SIZE_ROUTES), rng.choice(layouts), rng.choice(targets),
                            f"sz-{seed}-{i}"))
    return out


def size_body(case: SizeCase, pad: int, base_object: bool = False) -> dict[str, Any]:
    """The object a case writes, with ``pad`` bytes in its calibrated value (binary bytes for base64 fields);
    ``base_object``: the object an update route starts from (never immutable)."""
    meta: dict[str, Any] = {"name": case.name}
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": case.kind, "metadata": meta}
    filler = bytes((i * 7 + 3) % 256 for i in range(max(pad, 0)))
    b64 = base64.b64encode(filler).decode()
    text = "x" * max(pad, 0)
    secret = case.kind == "Secret"
    if case.layout == "many-keys":
        for j in range(40):
            if secret:
                obj.setdefault("data", {})[f"key-{j:03d}"] = base64.b64encode(b"v" * 100).decode()
            else:
                obj.setdefault("data", {})[f"key-{j:03d}"] = "v" * 100
    if case.layout == "labels":
        meta["labels"] = {f"pad-{j}": "l" * 63 for j in range(60)}
    if case.layout == "annotations":
        meta["annotations"] = {"note": "a" * 8000}
    if case.layout == "finalizers":
        meta["finalizers"] = [f"example.com/keep-{j}" for j in range(30)]
    if case.layout == "long-type":
        obj["type"] = "example.com/" + "t" * 300  # stored as written; counted above 253 characters
    if case.layout == "immutable":
        # True where the case creates the object; an update route's object stays mutable so it can be updated
        obj["immutable"] = case.route in ("create", "dry-run", "apply") and not base_object
    if case.layout == "string-data":
        obj["stringData"] = {"pad": text}
    elif case.layout == "data-and-string-data":
        obj["data"] = {"pad": base64.b64encode(b"overridden" * 500).decode(), "other": "b3RoZXI="}
        obj["stringData"] = {"pad": text}
    elif case.layout == "binary" and not secret:
        obj["binaryData"] = {"pad": b64}
    elif secret:
        obj.setdefault("data", {})["pad"] = b64
    else:
        obj.setdefault("data", {})["pad"] = text
    return obj
