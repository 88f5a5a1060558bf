"""Every kubernetes-asyncio call the webhook makes, in one edge module.

The webhook's Kubernetes-facing logic (templates, their reconciler, the namespace labels, the
DeviceClass map, the pod references) is written against small callables (``Create``, ``KubeOps``,
``ListFn``/``WatchFn``, ``ListClasses``) so it is tested without an apiserver. This module builds
those callables from one ``ApiClient``: it is the only place that knows the client library, and
the only webhook module that imports it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import (
    CoordinationV1Api,
    CoreV1Api,
    CustomObjectsApi,
    V1DeleteOptions,
    V1Preconditions,
)
from kubernetes_asyncio.client.exceptions import ApiException

from gatekeeper.webhook.deviceclasses import ListClasses
from gatekeeper.webhook.gpu.claims import MANAGED_BY
from gatekeeper.webhook.inventory.lease import Conflict, LeaseOps
from gatekeeper.webhook.kube_errors import describe
from gatekeeper.webhook.listwatch import ListFn, WatchFn, watch_event
from gatekeeper.webhook.namespace_modes import LABEL
from gatekeeper.webhook.pod_refs import REFERENCE, Key
from gatekeeper.webhook.template_lifecycle import KubeOps
from gatekeeper.webhook.templates import REQUEST_TIMEOUT, AlreadyExists, Create, TemplateError


async def api_client(kubeconfig: str) -> Any:
    """ApiClient from a kubeconfig file, or the in-cluster service account when empty."""
    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(configuration=cfg)


def list_watch(list_call: Callable[..., Any], watch_seconds: int = 300, relevant: bytes | None = None,
               **selectors: Any) -> tuple[ListFn, WatchFn]:
    """LIST and WATCH through a kubernetes-asyncio list function, as raw dicts (no model objects); the watch's
    lines are read and decoded here (listwatch.watch_event), ``relevant``: see there."""

    async def list_fn() -> tuple[list[dict[str, Any]], str]:
        resp: Any = await list_call(_preload_content=False, _request_timeout=30, **selectors)
        body = await resp.read()
        if resp.status >= 400:  # unparsed responses are not raised: a 403's Status read as a LIST had no items
            raise ApiException(status=resp.status, reason=body.decode(errors="replace")[:200])
        doc = orjson.loads(body)
        return list(doc.get("items") or []), str((doc.get("metadata") or {}).get("resourceVersion") or "")

    async def watch_fn(rv: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        # kubernetes-asyncio's Watch decoded every line with the json module, after a readline that cannot take
        # a line over aiohttp's buffer limit; here a chunk carries as many events as arrived together.
        resp: Any = await list_call(watch=True, _preload_content=False, resource_version=rv,
                                    timeout_seconds=watch_seconds, allow_watch_bookmarks=True, **selectors)
        try:
            if resp.status >= 400:
                body = await resp.read()
                raise ApiException(status=resp.status, reason=body.decode(errors="replace")[:200])
            rest = b""
            async for chunk in resp.content.iter_any():
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield watch_event(line, relevant)
            if rest.strip():
                yield watch_event(rest, relevant)
        finally:
            resp.release()

    return list_fn, watch_fn


def namespace_source(api: Any, watch_seconds: int = 300) -> tuple[ListFn, WatchFn]:
    """LIST and WATCH the namespaces carrying the GPU-mode label."""
    return list_watch(CoreV1Api(api).list_namespace, watch_seconds, label_selector=LABEL)


def pod_source(api: Any, watch_seconds: int = 300) -> tuple[ListFn, WatchFn]:
    """All pods (a template's pods may be anywhere in its namespace, with no label to select them by); only the
    events of pods that name a template are decoded (a pod's resourceClaims cannot change after its creation,
    so a pod without the word never had a reference the index could hold)."""
    return list_watch(CoreV1Api(api).list_pod_for_all_namespaces, watch_seconds, relevant=REFERENCE)


def dra_source(api: Any, plural: str, watch_seconds: int = 300) -> tuple[ListFn, WatchFn]:
    """LIST and WATCH a cluster-wide resource.k8s.io/v1 resource (resourceslices, resourceclaims) as raw dicts."""
    custom = CustomObjectsApi(api)

    async def list_call(*args: Any, **kwargs: Any) -> Any:
        return await custom.list_cluster_custom_object("resource.k8s.io", "v1", plural, **kwargs)

    return list_watch(list_call, watch_seconds)


def lease_ops(api: Any, name: str, namespace: str, request_timeout: float = 5.0) -> LeaseOps:
    """Read, create and replace (resourceVersion precondition) one coordination.k8s.io/v1 Lease, as dicts."""
    coord = CoordinationV1Api(api)

    async def get() -> dict[str, Any] | None:
        try:
            resp: Any = await coord.read_namespaced_lease(name, namespace, _preload_content=False,
                                                          _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        body = await resp.read()
        if resp.status == 404:  # unparsed responses are not raised as ApiException
            return None
        if resp.status >= 400:
            raise ApiException(status=resp.status, reason=body.decode(errors="replace")[:200])
        doc: dict[str, Any] = orjson.loads(body)
        return doc

    async def write(call: Any, *args: Any) -> dict[str, Any] | None:
        """The Lease as written, undecoded into models (a renewal every few seconds, forever)."""
        try:
            resp: Any = await call(*args, _preload_content=False, _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict() from None
            raise
        body = await resp.read()
        if resp.status == 409:
            raise Conflict()
        if resp.status >= 400:
            raise ApiException(status=resp.status, reason=body.decode(errors="replace")[:200])
        doc = orjson.loads(body)
        return doc if isinstance(doc, dict) else None

    async def create(body: dict[str, Any]) -> dict[str, Any] | None:
        return await write(coord.create_namespaced_lease, namespace, body)

    async def replace(body: dict[str, Any]) -> dict[str, Any] | None:
        return await write(coord.replace_namespaced_lease, name, namespace, body)

    return LeaseOps(get, create, replace)


def device_class_lister(api: Any, request_timeout: float = 5.0) -> ListClasses:
    """LIST resource.k8s.io/v1 deviceclasses."""
    custom = CustomObjectsApi(api)

    async def list_classes() -> list[dict[str, Any]]:
        doc = await custom.list_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses",
                                                      _request_timeout=request_timeout)
        items = doc.get("items") if isinstance(doc, dict) else None
        return items if isinstance(items, list) else []

    return list_classes


def template_creator(api: Any, request_timeout: float = REQUEST_TIMEOUT) -> Create:
    """``create`` for the TemplateKeeper: POST .../resourceclaimtemplates, errors as the user's message."""
    custom = CustomObjectsApi(api)

    async def create(obj: dict[str, Any]) -> None:
        group, version = obj["apiVersion"].split("/")
        meta = obj["metadata"]
        try:
            await custom.create_namespaced_custom_object(group, version, meta["namespace"],
                                                         "resourceclaimtemplates", obj,
                                                         _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status == 409:
                raise AlreadyExists() from None
            raise TemplateError(
                f"gatekeeper could not create ResourceClaimTemplate {meta['namespace']}/{meta['name']}: "
                f"{describe(exc)}; the pod would stay Pending, so it was not admitted"
            ) from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise TemplateError(
                f"gatekeeper could not reach the apiserver to create ResourceClaimTemplate "
                f"{meta['namespace']}/{meta['name']}: {describe(exc)}"
            ) from None

    return create


def template_ops(api: Any, request_timeout: float = 10.0) -> KubeOps:
    """The template reconciler's LIST, create and delete (with a UID precondition)."""
    custom = CustomObjectsApi(api)
    selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())

    async def list_templates() -> list[dict[str, Any]]:
        doc = await custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceclaimtemplates",
                                                      label_selector=selector, _request_timeout=request_timeout)
        return list(doc.get("items") or [])

    async def create(obj: dict[str, Any]) -> None:
        try:
            await custom.create_namespaced_custom_object("resource.k8s.io", "v1", obj["metadata"]["namespace"],
                                                         "resourceclaimtemplates", obj,
                                                         _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status != 409:
                raise

    async def delete(key: Key, uid: str) -> None:
        body = V1DeleteOptions(preconditions=V1Preconditions(uid=uid) if uid else None)
        try:
            await custom.delete_namespaced_custom_object("resource.k8s.io", "v1", key[0], "resourceclaimtemplates",
                                                         key[1], body=body, _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    return KubeOps(list_templates, create, delete)
