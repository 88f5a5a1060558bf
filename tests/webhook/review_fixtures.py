"""Builders for AdmissionReview v1 fixtures and a helper that applies a response's patch."""

from __future__ import annotations

import base64
import copy
import uuid
from typing import Any

import jsonpatch
import orjson

from gatekeeper.kube.admission import AdmissionReviewDict, review_from_dict


def b64(n: int) -> str:
    """base64 of n bytes (bytes chosen so every padding length appears)."""
    return base64.b64encode(bytes(i % 251 for i in range(n))).decode()


def review(
    obj: dict[str, Any] | None,
    *,
    kind: str | None = None,
    operation: str = "CREATE",
    namespace: str = "team-a",
    old: dict[str, Any] | None = None,
    dry_run: bool = False,
    group: str = "",
) -> dict[str, Any]:
    kind = kind or (obj or old or {}).get("kind", "Secret")
    resource = {"Secret": "secrets", "ConfigMap": "configmaps", "Pod": "pods"}.get(kind, kind.lower() + "s")
    meta = (obj or old or {}).get("metadata", {})
    req: dict[str, Any] = {
        "uid": str(uuid.uuid4()),
        "kind": {"group": group, "version": "v1", "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": resource},
        "operation": operation,
        "namespace": namespace,
        "name": meta.get("name", ""),
        "userInfo": {"username": "dev"},
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def request(doc: dict[str, Any]):  # type: ignore[no-untyped-def]
    return review_from_dict(doc)


def _meta(name: str, generate_name: str, annotations: dict[str, str] | None) -> dict[str, Any]:
    """Object metadata in namespace team-a; no name with generate_name models a generateName create."""
    meta: dict[str, Any] = {"namespace": "team-a"}
    if name:
        meta["name"] = name
    if generate_name:
        meta["generateName"] = generate_name
    if annotations is not None:
        meta["annotations"] = annotations
    return meta


def secret(name: str = "model-certs", *, data: dict[str, str] | None = None,
           string_data: dict[str, str] | None = None, type_: str = "Opaque",
           annotations: dict[str, str] | None = None, generate_name: str = "") -> dict[str, Any]:
    meta = _meta(name, generate_name, annotations)
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": type_}
    if data is not None:
        obj["data"] = data
    if string_data is not None:
        obj["stringData"] = string_data
    return obj


def container(name: str, gpus: int | str | None = None, *, where: str = "limits",
              extra: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "registry.example/cuda:12", **fields}
    res: dict[str, Any] = {}
    if gpus is not None:
        for w in (["limits", "requests"] if where == "both" else [where]):
            res[w] = {"nvidia.com/gpu": gpus, **(extra or {})}
    elif extra:
        res["limits"] = dict(extra)
    if res:
        c["resources"] = res
    return c


def pod(*containers: dict[str, Any], init: list[dict[str, Any]] | None = None, name: str = "trainer",
        generate_name: str = "", annotations: dict[str, str] | None = None,
        resource_claims: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    meta = _meta(name, generate_name, annotations)
    spec: dict[str, Any] = {"containers": list(containers)}
    if init is not None:
        spec["initContainers"] = init
    if resource_claims is not None:
        spec["resourceClaims"] = resource_claims
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def apply(obj: dict[str, Any], resp: AdmissionReviewDict) -> dict[str, Any]:
    """Apply the (base64 JSON Patch) of a response to a copy of obj, as the apiserver does."""
    r = resp["response"]
    if "patch" not in r:
        return copy.deepcopy(obj)
    assert r.get("patchType") == "JSONPatch"
    ops = orjson.loads(base64.b64decode(r["patch"]))
    return jsonpatch.apply_patch(copy.deepcopy(obj), ops)
