"""Differential admission fuzz: seeded variants through the real kube-apiserver, the apiserver as the oracle.

A module sandbox of its own (1 apiserver, scheduler + controller manager, 1 KWOK GPU node, the webhook
with enforced namespaces and an opt-out group). Every variant is sent twice by the same tenant identity:
once to ``fz-exempt`` (labelled ``gatekeeper.dev/exempt=true``, so no webhook sees it: what the apiserver
alone makes of it) and once where the webhook runs. Then what the apiserver stored (or, for dry-run,
returned) is read back and judged by admission_fuzz.py's oracles, written from the docs (docs/webhook/), not the code:

* no stored Pod asks for ``nvidia.com/gpu`` unless the policy lets whole GPUs through;
* a Pod the apiserver alone accepts is never refused unless the webhook denies it for a documented reason
  (no 500, no failed call, no patch the apiserver then finds invalid);
* no Secret/ConfigMap is stored above the hard limit, and none at or under it is denied.

Seeds and counts are fixed; a failure prints the minimal variant (one object, one route) that disagreed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from admission_fuzz import (
    EXEMPT,
    GPU,
    IMAGE,
    NAMESPACES,
    WEBHOOK_CONFIG,
    PodCase,
    SizeCase,
    asks_whole_gpus,
    documented_size,
    expected_denial,
    pod_cases,
    size_body,
    size_cases,
    whole_gpus_allowed,
)

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import admin_client, metric_sum, webhook_sandbox

pytestmark = pytest.mark.sandbox

SEED = 20261202
POD_CASES = 300
SIZE_CASES = 80
HARD = 128 * 1024
CONCURRENCY = 4
TENANT = {"Impersonate-User": "fuzz-tenant", "Impersonate-Group": "fuzz:tenants"}
OPT_OUT = [("Impersonate-User", "fuzz-admin"), ("Impersonate-Group", "fuzz:tenants"),
           ("Impersonate-Group", "gpu-admins")]
TENANT_RBAC = {"apiVersion": "v1", "kind": "List", "items": [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "fuzz-tenant"},
     "rules": [{"apiGroups": [""], "verbs": ["*"],
                "resources": ["pods", "pods/resize", "pods/ephemeralcontainers", "secrets", "configmaps"]},
               {"apiGroups": ["apps", "batch"], "resources": ["deployments", "jobs"], "verbs": ["*"]},
               {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["get", "list"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "fuzz-tenant"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "fuzz-tenant"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "fuzz:tenants"}]},
]}
GPU_DENIED = 'admission webhook "gpu.gatekeeper.dev" denied the request'
SIZE_DENIED = 'admission webhook "secrets.gatekeeper.dev" denied the request'


@pytest.fixture(scope="module")
def fuzz_sandbox(tmp_path_factory: pytest.TempPathFactory, own_sandbox: Any) -> Iterator[SandboxState]:
    with webhook_sandbox(tmp_path_factory.mktemp("admission-fuzz"), WEBHOOK_CONFIG, own_sandbox, "--apiservers", "1",
                         "--gpu-nodes", "1", "--with-scheduler") as state:
        asyncio.run(_prepare(state))
        yield state


def _client(state: SandboxState) -> httpx.AsyncClient:
    return admin_client(state, timeout=60)


async def _prepare(state: SandboxState) -> None:
    async with _client(state) as c:
        for item in TENANT_RBAC["items"]:
            group = "rbac.authorization.k8s.io/v1"
            plural = "clusterroles" if item["kind"] == "ClusterRole" else "clusterrolebindings"
            r = await c.post(f"/apis/{group}/{plural}", json=item)
            assert r.status_code in (201, 409), r.text
        for ns in NAMESPACES:
            labels = {"gatekeeper.dev/exempt": "true"} if ns.exempt else {}
            r = await c.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": ns.name, "labels": labels}})
            assert r.status_code in (201, 409), r.text

    async def ready() -> bool:
        async with _client(state) as c:
            for ns in NAMESPACES:
                for path in (f"/api/v1/namespaces/{ns.name}/serviceaccounts/default",
                             f"/api/v1/namespaces/{ns.name}/configmaps/kube-root-ca.crt"):
                    if (await c.get(path)).status_code != 200:
                        return False
        return True

    for _ in range(240):
        if await ready():
            return
        await asyncio.sleep(0.25)
    raise AssertionError("fuzz namespaces: no default ServiceAccount / kube-root-ca.crt after 60 s")


class Api:
    """The tenant's calls, as raw HTTP so the content type (JSON, merge, strategic, JSON patch, apply),
    dry-run and subresource are exactly the variant's."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.c = client

    async def call(self, method: str, path: str, body: Any = None, *, ctype: str = "application/json",
                   dry: bool = False, opt_out: bool = False, params: dict[str, str] | None = None,
                   ) -> tuple[int, dict[str, Any]]:
        headers: Any = list(OPT_OUT) if opt_out else list(TENANT.items())
        headers.append(("Content-Type", ctype))
        q = dict(params or {})
        if dry:
            q["dryRun"] = "All"
        content = None if body is None else json.dumps(body).encode()
        r = await self.c.request(method, path, content=content, headers=headers, params=q)
        try:
            doc = r.json()
        except ValueError:
            doc = {"message": r.text}
        return r.status_code, doc if isinstance(doc, dict) else {"message": str(doc)}


@pytest.fixture
async def api(fuzz_sandbox: SandboxState) -> AsyncIterator[Api]:
    async with _client(fuzz_sandbox) as c:
        yield Api(c)


def _ok(status: int) -> bool:
    return 200 <= status < 300


def _pods(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/pods"


async def _send_pod(api: Api, case: PodCase, ns: str, *, dry: bool) -> tuple[int, dict[str, Any]]:
    body = json.loads(json.dumps(case.pod))
    body["metadata"]["namespace"] = ns
    if case.route.startswith("apply"):
        return await api.call("PATCH", f"{_pods(ns)}/{body['metadata']['name']}", body,
                              ctype="application/apply-patch+yaml", dry=dry, opt_out=case.opt_out,
                              params={"fieldManager": "fuzz"})
    return await api.call("POST", _pods(ns), body, dry=dry, opt_out=case.opt_out)


def judge_pod(case: PodCase, base: tuple[int, dict[str, Any]], got: tuple[int, dict[str, Any]],
              stored: dict[str, Any] | None) -> str:
    """'' if the webhook path agrees with the policy and the apiserver, else what disagreed."""
    status, doc = got
    ns = case.namespace
    denial = expected_denial(ns, case.pod, case.opt_out)
    if _ok(status):
        assert stored is not None
        if asks_whole_gpus(stored) and not whole_gpus_allowed(ns, case.pod, case.opt_out):
            asked = [(c["name"], c.get("resources")) for c in stored["spec"].get("initContainers", [])
                     + stored["spec"]["containers"]]
            return f"BYPASS: stored pod still asks for {GPU}: {json.dumps(asked)[:600]}"
        if denial:
            return f"admitted although the policy denies it ({denial})"
        return ""
    message = str(doc.get("message", ""))
    if status >= 500 or "failed calling webhook" in message or "internal error" in message.lower():
        return f"webhook error {status}: {message[:400]}"
    if not _ok(base[0]):
        return ""  # the apiserver alone refuses it too
    if GPU_DENIED not in message:
        return f"a pod the apiserver accepts became invalid through the webhook ({status}): {message[:400]}"
    if not denial:
        return f"denied a pod the policy admits: {message[:400]}"
    return ""


async def test_gpu_pods_never_bypass_the_rewrite_and_valid_pods_stay_valid(api: Api) -> None:
    """300 seeded Pod variants x (create, dry-run, server-side apply, its dry-run) in enforced dra, time-slicing
    and shared namespaces, an open one and an exempt one, by a tenant and by an opt-out user."""
    cases = pod_cases(SEED, POD_CASES, NAMESPACES)
    sem = asyncio.Semaphore(CONCURRENCY)
    problems: list[str] = []
    stored_pods: list[tuple[PodCase, str]] = []

    async def one(case: PodCase) -> None:
        async with sem:
            base = await _send_pod(api, case, EXEMPT.name, dry=True)
            dry = case.route.endswith("dry-run")
            got = await _send_pod(api, case, case.namespace.name, dry=dry)
            stored = None
            if _ok(got[0]):
                name = got[1]["metadata"]["name"]
                stored = got[1] if dry else (await api.call("GET", f"{_pods(case.namespace.name)}/{name}"))[1]
                if not dry:
                    stored_pods.append((case, name))
        verdict = judge_pod(case, base, got, stored)
        if verdict:
            problems.append(f"{verdict}\n  {case.describe()}")

    await asyncio.gather(*(one(c) for c in cases))
    assert not problems, f"{len(problems)} of {len(cases)} variants disagreed:\n" + "\n".join(problems[:10])
    rewritten = [c for c, _ in stored_pods if not c.namespace.exempt and asks_whole_gpus(c.pod)]
    assert len(stored_pods) > 40 and len(rewritten) > 10, "the variants must reach the webhook's rewrite paths"

    # Later writes of what was stored: a spec update, an in-place resize, an ephemeral container, dropping the
    # claims. Resources are immutable but for cpu/memory through pods/resize, and ephemeral containers may not
    # have resources (v1.37.2 refuses all four); the oracle reads what is stored, whatever the answer.
    add_gpu = {"spec": {"containers": [{"name": "app0", "resources": {"limits": {GPU: "1"}, "requests": {GPU: "1"}}}]}}
    ephemeral = {"spec": {"ephemeralContainers": [{"name": "dbg", "image": IMAGE, "targetContainerName": "app0",
                                                    "resources": {"limits": {GPU: "1"}}}]}}
    for case, name in stored_pods[:16]:
        path = f"{_pods(case.namespace.name)}/{name}"
        writes = [(path, add_gpu, "application/strategic-merge-patch+json"),
                  (f"{path}/resize", add_gpu, "application/strategic-merge-patch+json"),
                  (f"{path}/ephemeralcontainers", ephemeral, "application/strategic-merge-patch+json"),
                  (path, [{"op": "remove", "path": "/spec/resourceClaims"}], "application/json-patch+json")]
        for where, patch, ctype in writes:
            status, doc = await api.call("PATCH", where, patch, ctype=ctype, opt_out=case.opt_out)
            assert status < 500, (where, doc)
            _, after = await api.call("GET", path)
            if asks_whole_gpus(after) and not whole_gpus_allowed(case.namespace, case.pod, case.opt_out):
                problems.append(f"BYPASS after PATCH {where} ({status}): {case.describe()}")
    assert not problems, "\n".join(problems[:10])


async def test_pods_made_by_deployments_and_jobs_are_rewritten_too(api: Api) -> None:
    """The controller creates the Pod under its own ServiceAccount: the webhook sees it, the tenant's opt-out
    group does not come along (docs/webhook/gpu-modes.md: opt-out applies to the identity that creates the Pod)."""
    expect_pod: dict[str, bool] = {}
    owners: dict[str, PodCase] = {}
    for i, case in enumerate(c for c in pod_cases(SEED + 1, 200, NAMESPACES) if not c.namespace.exempt):
        if sum(expect_pod.values()) >= 8 and len(expect_pod) - sum(expect_pod.values()) >= 4:
            break
        ns = case.namespace.name
        template = json.loads(json.dumps(case.pod))
        meta = template["metadata"]
        ctl = f"ctl-{i}"
        meta.pop("name")
        meta["labels"] = {"fuzz-ctl": ctl}
        base_pod = {**template, "metadata": {**meta, "name": f"ctl-base-{i}"}}
        if i % 2:
            template["spec"]["restartPolicy"] = "Never"
            base_pod["spec"] = template["spec"]
            body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": ctl},
                    "spec": {"backoffLimit": 0, "template": {"metadata": meta, "spec": template["spec"]}}}
            path = f"/apis/batch/v1/namespaces/{ns}/jobs"
        else:
            body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": ctl},
                    "spec": {"replicas": 1, "selector": {"matchLabels": {"fuzz-ctl": ctl}},
                             "template": {"metadata": meta, "spec": template["spec"]}}}
            path = f"/apis/apps/v1/namespaces/{ns}/deployments"
        base = await api.call("POST", _pods(EXEMPT.name), base_pod, dry=True)
        admitted = _ok(base[0]) and not expected_denial(case.namespace, case.pod, opt_out=False)
        if not _ok(base[0]) or sum(v == admitted for v in expect_pod.values()) >= (8 if admitted else 4):
            continue  # enough of this kind; templates the apiserver alone refuses make no pods anyway
        status, doc = await api.call("POST", path, body)
        if not _ok(status):
            assert status < 500, doc
            continue
        # The controller is not in optOutGroups, so judge as a tenant without opt-out.
        expect_pod[ctl] = admitted
        owners[ctl] = case
    assert sum(expect_pod.values()) >= 8 and len(expect_pod) >= 12, expect_pod

    async def created() -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for ctl, case in owners.items():
            _, doc = await api.call("GET", _pods(case.namespace.name), params={"labelSelector": f"fuzz-ctl={ctl}"})
            out[ctl] = doc.get("items", [])
        return out

    pods: dict[str, list[dict[str, Any]]] = {}
    for _ in range(240):
        pods = await created()
        if all(pods[ctl] for ctl, want in expect_pod.items() if want):
            break
        await asyncio.sleep(0.5)
    missing = [owners[ctl].describe() for ctl, want in expect_pod.items() if want and not pods[ctl]]
    assert not missing, "controllers made no pod for templates the policy admits:\n" + "\n".join(missing)
    for ctl, items in pods.items():
        for pod in items:
            case = owners[ctl]
            assert not (asks_whole_gpus(pod) and not whole_gpus_allowed(case.namespace, case.pod, opt_out=False)), \
                f"BYPASS through a controller: {case.describe()}"


# --- sizes ---------------------------------------------------------------------------------------------------

UPDATE_ROUTES = ("put", "json-patch", "merge-patch", "strategic-patch", "apply-update")


def _plural(kind: str) -> str:
    return "secrets" if kind == "Secret" else "configmaps"


def _patch_for(case: SizeCase, body: dict[str, Any]) -> tuple[Any, str]:
    fields = {k: body[k] for k in ("data", "stringData", "binaryData") if k in body}
    if case.route == "json-patch":
        ops = [{"op": "add", "path": f"/{k}/{key}", "value": v}
               for k, m in fields.items() if k != "stringData" for key, v in m.items()]
        ops += [{"op": "add", "path": "/stringData", "value": fields["stringData"]}] if "stringData" in fields else []
        meta = body["metadata"]
        ops += [{"op": "add", "path": f"/metadata/{k}", "value": meta[k]}
                for k in ("labels", "annotations") if k in meta]
        return ops, "application/json-patch+json"
    patch = {**fields, "metadata": {k: v for k, v in body["metadata"].items() if k in ("labels", "annotations")}}
    ctype = "application/merge-patch+json" if case.route == "merge-patch" else "application/strategic-merge-patch+json"
    return patch, ctype


async def _write(api: Api, case: SizeCase, ns: str, pad: int, *, dry: bool,
                 route: str = "") -> tuple[int, dict[str, Any]]:
    """The case's write of ``pad`` bytes in ``ns`` (its base object already there for update routes);
    ``route`` given: the base object's own create (never immutable, so the update can follow)."""
    route = route or case.route
    base = f"/api/v1/namespaces/{ns}/{_plural(case.kind)}"
    body = size_body(case, pad, base_object=route != case.route)
    body["metadata"]["namespace"] = ns
    if route in ("create", "dry-run"):
        return await api.call("POST", base, body, dry=dry)
    if route in ("apply", "apply-update"):
        return await api.call("PATCH", f"{base}/{case.name}", body, ctype="application/apply-patch+yaml", dry=dry,
                              params={"fieldManager": "fuzz"})
    if case.route == "put":
        return await api.call("PUT", f"{base}/{case.name}", body, dry=dry)
    patch, ctype = _patch_for(case, body)
    return await api.call("PATCH", f"{base}/{case.name}", patch, ctype=ctype, dry=dry)


async def _size_of(api: Api, case: SizeCase, ns: str) -> int | None:
    status, doc = await api.call("GET", f"/api/v1/namespaces/{ns}/{_plural(case.kind)}/{case.name}")
    return documented_size(doc) if _ok(status) else None


async def _run_size_case(api: Api, case: SizeCase, target_ns: str) -> tuple[str, int]:
    """(what disagreed or '', the size the apiserver alone would store)."""
    dry = case.route == "dry-run"
    if case.route in UPDATE_ROUTES and case.name != "kube-root-ca.crt":
        for ns in (EXEMPT.name, target_ns):
            route = "apply" if case.route == "apply-update" else "create"
            status, doc = await _write(api, case, ns, 10, dry=False, route=route)
            assert _ok(status), doc
    # Calibrate the pad against what the apiserver alone would store (dry-run where no webhook runs).
    pad = max(case.target - 2000, 0)
    for _ in range(2):
        status, doc = await _write(api, case, EXEMPT.name, pad, dry=True)
        assert _ok(status), (case.describe(), doc)
        pad = max(pad + case.target - documented_size(doc), 0)
    status, doc = await _write(api, case, EXEMPT.name, pad, dry=dry)
    assert _ok(status), (case.describe(), doc)
    would_store = documented_size(doc)
    status, doc = await _write(api, case, target_ns, pad, dry=dry)
    message = str(doc.get("message", ""))
    verdict = ""
    if status >= 500 or "failed calling webhook" in message:
        verdict = f"webhook error {status}: {message[:300]}"
    elif would_store <= HARD and not _ok(status):
        verdict = f"denied at {would_store} bytes (limit {HARD}): {message[:300]}"
    elif would_store > HARD and _ok(status):
        verdict = f"BYPASS: admitted at {would_store} bytes (limit {HARD})"
    elif would_store > HARD and SIZE_DENIED not in message:
        verdict = f"over the limit but not refused by the webhook ({status}): {message[:300]}"
    stored = None if dry else await _size_of(api, case, target_ns)
    if not verdict and stored is not None and stored > HARD:
        verdict = f"BYPASS: stored at {stored} bytes (limit {HARD})"
    return verdict, would_store


async def test_secrets_and_configmaps_are_never_stored_over_the_limit_nor_denied_under_it(api: Api) -> None:
    """80 seeded Secrets/ConfigMaps aimed at one byte under, at and over the hard limit (and further off),
    through create, dry-run, server-side apply, PUT, JSON/merge/strategic patch and apply updates, with data,
    stringData, both, binary bytes, many keys, labels, annotations and immutable; plus a tenant's patches of
    the ``kube-root-ca.crt`` ConfigMap kube-controller-manager publishes."""
    cases = size_cases(SEED, SIZE_CASES, HARD)
    for target in (HARD * 2, HARD - 1, HARD + 1):
        cases.append(SizeCase(len(cases), "ConfigMap", "merge-patch", "binary", target, "kube-root-ca.crt"))
    sem = asyncio.Semaphore(CONCURRENCY)
    root_ca = asyncio.Lock()  # one object per namespace: its cases take turns
    problems: list[str] = []
    sizes: list[int] = []

    async def one(case: SizeCase) -> None:
        async with sem:
            if case.name == "kube-root-ca.crt":
                async with root_ca:
                    verdict, size = await _run_size_case(api, case, "fz-open")
            else:
                verdict, size = await _run_size_case(api, case, "fz-open")
        sizes.append(size)
        if verdict:
            problems.append(f"{verdict}\n  {case.describe()}")

    await asyncio.gather(*(one(c) for c in cases))
    assert not problems, f"{len(problems)} of {len(cases)} variants disagreed:\n" + "\n".join(problems[:10])
    # The calibration hits the boundary exactly, so an off-by-one in the policy cannot hide.
    assert sizes.count(HARD) >= 3 and sizes.count(HARD + 1) >= 3, sorted(sizes)


async def test_a_tenants_oversized_kube_root_ca_configmap_is_denied_and_new_namespaces_still_get_theirs(
        api: Api, fuzz_sandbox: SandboxState) -> None:
    """The fuzz's finding, minimised: the name alone was exempt, so 300 KiB of binaryData was stored there."""
    patch = {"binaryData": {"blob": base64.b64encode(b"\x01" * (300 * 1024)).decode()}}
    path = "/api/v1/namespaces/fz-open/configmaps/kube-root-ca.crt"
    status, doc = await api.call("PATCH", path, patch, ctype="application/merge-patch+json")
    assert status == 403 and SIZE_DENIED in doc.get("message", ""), (status, doc.get("message"))
    status, _ = await api.call("PATCH", path.replace("fz-open", EXEMPT.name), patch,
                               ctype="application/merge-patch+json", dry=True)
    assert _ok(status)  # the apiserver alone takes it: only the webhook stands in the way
    # kube-controller-manager's own write of the name is still exempt (never sent to the webhook, so it never
    # waits on it): a new namespace gets its CA bundle, and the webhook reviewed no write for it.
    name = f"fz-new-{uuid.uuid4().hex[:6]}"
    reviews_before = await _size_reviews(fuzz_sandbox)
    async with _client(fuzz_sandbox) as admin:
        assert (await admin.post("/api/v1/namespaces", json={"metadata": {"name": name}})).status_code == 201

        async def published() -> bool:
            return (await admin.get(f"/api/v1/namespaces/{name}/configmaps/kube-root-ca.crt")).status_code == 200

        for _ in range(120):
            if await published():
                break
            await asyncio.sleep(0.25)
        assert await published(), "kube-controller-manager did not publish kube-root-ca.crt"
        assert await _size_reviews(fuzz_sandbox) == reviews_before
        await admin.delete(f"/api/v1/namespaces/{name}")


async def _size_reviews(state: SandboxState) -> float:
    """Size-policy reviews the webhook answered so far (its /metrics)."""
    certs = SandboxPKI(Path(state.certs_dir))
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(certs.ca)), timeout=30) as c:
        text = (await c.get(state.extra["webhook"]["url"] + "/metrics")).text
    return metric_sum(text, "gatekeeper_webhook_reviews_total", policy="secret-size")


async def test_opt_out_is_the_pod_creators_so_it_does_not_travel_through_a_controller(api: Api) -> None:
    """optOutGroups is matched against who creates the Pod. A Deployment's Pods are created by the ReplicaSet
    controller's ServiceAccount, so an opt-out user's ``gpu-mode: off`` template in an enforced namespace is
    denied (docs/webhook/gpu-modes.md says so); the same pod created by that user directly keeps its whole GPU."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "optout-direct", "annotations": {"gatekeeper.dev/gpu-mode": "off"},
                        "labels": {"fuzz-ctl": "optout"}},
           "spec": {"containers": [{"name": "app0", "image": IMAGE, "resources": {"limits": {GPU: "1"}}}]}}
    status, doc = await api.call("POST", _pods("fz-dra"), pod, opt_out=True)
    assert status == 201 and asks_whole_gpus(doc), doc
    meta = {"labels": {"fuzz-ctl": "optout"}, "annotations": pod["metadata"]["annotations"]}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "optout"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"fuzz-ctl": "optout"}},
                           "template": {"metadata": meta, "spec": pod["spec"]}}}
    status, doc = await api.call("POST", "/apis/apps/v1/namespaces/fz-dra/deployments", deployment, opt_out=True)
    assert status == 201, doc
    failure = ""
    for _ in range(240):
        _, sets = await api.call("GET", "/apis/apps/v1/namespaces/fz-dra/replicasets",
                                 params={"labelSelector": "fuzz-ctl=optout"})
        conditions = [c for rs in sets.get("items", []) for c in rs.get("status", {}).get("conditions") or []]
        failure = next((c.get("message", "") for c in conditions if c.get("type") == "ReplicaFailure"), "")
        if failure:
            break
        await asyncio.sleep(0.5)
    assert GPU_DENIED in failure and "gpu-admins" in failure, failure
    _, pods = await api.call("GET", _pods("fz-dra"), params={"labelSelector": "fuzz-ctl=optout"})
    assert [p["metadata"]["name"] for p in pods["items"]] == ["optout-direct"]


async def test_a_controller_may_relabel_an_oversized_secret_it_did_not_write_but_not_grow_it(
        api: Api, fuzz_sandbox: SandboxState) -> None:
    """An oversized Secret from before the webhook (made here in an exempt namespace whose label is then removed)
    stays editable without growing. The managedFields entry the apiserver adds for a new field manager counted as
    growth, so a controller changing one label was refused "over the 128 KiB limit"."""
    ns = "fz-legacy"
    async with _client(fuzz_sandbox) as admin:
        r = await admin.post("/api/v1/namespaces", json={"metadata": {"name": ns,
                                                                      "labels": {"gatekeeper.dev/exempt": "true"}}})
        assert r.status_code == 201, r.text
        for _ in range(240):  # the namespace is exempt once the apiserver's informer has its label
            status, _ = await api.call("POST", f"/api/v1/namespaces/{ns}/secrets", {
                "metadata": {"name": "legacy", "labels": {"team": "a"}},
                "data": {"blob": base64.b64encode(b"\x02" * (200 * 1024)).decode()}})
            if _ok(status):
                break
            await asyncio.sleep(0.25)
        assert _ok(status)
        unlabel = {"metadata": {"labels": {"gatekeeper.dev/exempt": None}}}
        r = await admin.patch(f"/api/v1/namespaces/{ns}", json=unlabel,
                              headers={"Content-Type": "application/merge-patch+json"})
        assert r.status_code == 200, r.text
    path = f"/api/v1/namespaces/{ns}/secrets/legacy"
    grow = {"data": {"more": base64.b64encode(b"x").decode()}}
    for _ in range(240):  # enforced again once the apiserver sees the label gone
        status, doc = await api.call("PATCH", path, grow, ctype="application/merge-patch+json", dry=True)
        if status == 403:
            break
        await asyncio.sleep(0.25)
    assert status == 403 and SIZE_DENIED in doc.get("message", ""), doc
    relabel = {"metadata": {"labels": {"team": "b"}}}
    status, doc = await api.call("PATCH", path, relabel, ctype="application/merge-patch+json",
                                 params={"fieldManager": "other-controller"})
    assert status == 200, doc.get("message")
    assert "other-controller" in [m["manager"] for m in doc["metadata"]["managedFields"]]
    status, doc = await api.call("PATCH", path, grow, ctype="application/merge-patch+json",
                                 params={"fieldManager": "third-controller"})
    assert status == 403 and SIZE_DENIED in doc.get("message", ""), doc
