"""GPU packing on a mixed fleet: 48 inference pods with mixed asks, three ways, through the real scheduler.

    gatekeeper sandbox up --state-dir DIR --apiservers 1 --mixed-fleet --with-scheduler --with-webhook
    python -m loadtest bench gpu-packing --state-dir DIR --out loadtest/reports/DATE-gpu-packing-mixed

The 48 pods (fixed seed) ask as people write them: 12 by memory (``gpu-memory`` 10-20Gi, mode shared), 8 by
count (mode ``shares``), 8 by model (4 whole A100s, 4 shared H100 slots of 16Gi), 10 by HAMi resources (6
``gpumem`` of 8000-16000 MiB, 4 ``gpumem-percentage: 25``) and 10 by fallbacks (``mig-dra,shared,dra`` with
10-20Gi). Each arm runs them in a fresh namespace and frees everything before the next:

* ``whole``: every pod a whole GPU (mode ``dra``), what the device plugin gives;
* ``today-shared``: every pod the claim today's ``shared`` mode wrote (79209ad: a memory capacity request and
  no selector), created by this bench as the pod's own ResourceClaimTemplate (the webhook now writes selectors);
* ``asks``: every pod as asked, through the webhook.

Per arm: pods placed and left Pending, GPUs used (a MIG partition counts its GPU), share asks that hold a
whole exclusive GPU, and memory committed on the GPUs used, computed by the inventory's own function
(gatekeeper.webhook.inventory.committed) and checked against the webhook's ``gatekeeper_gpu_*`` series.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import metric_sum
from gatekeeper.webhook.inventory.committed import gpu_rows

GIB = 1024**3
SHARE_KINDS = ("memory", "count", "model-shared", "alias-mem", "alias-pct")
"""Asks for a share of a GPU: holding a whole exclusive GPU is the failure the issue is about."""


@dataclass(frozen=True)
class Ask:
    """One pod's ask, and the memory today's shared mode would have asked for it."""

    kind: str
    annotations: dict[str, str]
    limits: dict[str, str]
    today_gib: int


def asks(seed: int = 44) -> list[Ask]:
    rng = random.Random(seed)
    out = [Ask("memory", {"gatekeeper.dev/gpu-mode": "shared", "gatekeeper.dev/gpu-memory": f"{g}Gi"}, {}, g)
           for g in (rng.randint(10, 20) for _ in range(12))]
    out += [Ask("count", {"gatekeeper.dev/gpu-mode": "shares"}, {}, 10) for _ in range(8)]
    out += [Ask("model-whole", {"gatekeeper.dev/gpu-mode": "dra", "gatekeeper.dev/gpu-models": "A100-40GB"}, {}, 40)
            for _ in range(4)]
    out += [Ask("model-shared", {"gatekeeper.dev/gpu-mode": "shared", "gatekeeper.dev/gpu-memory": "16Gi",
                                 "gatekeeper.dev/gpu-models": "H100-80GB"}, {}, 16) for _ in range(4)]
    out += [Ask("alias-mem", {}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(m)}, -(-m // 1024))
            for m in (rng.randint(8000, 16000) for _ in range(6))]
    out += [Ask("alias-pct", {}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25"}, 20) for _ in range(4)]
    out += [Ask("fallback", {"gatekeeper.dev/gpu-fallbacks": "mig-dra,shared,dra", "gatekeeper.dev/gpu-memory":
                             f"{g}Gi"}, {}, g) for g in (rng.randint(10, 20) for _ in range(10))]
    rng.shuffle(out)
    return out


@dataclass
class Arm:
    """What one arm placed and what it held."""

    name: str
    pods: int
    placed: int = 0
    pending: int = 0
    gpus_used: int = 0
    gpus_total: int = 0
    share_asks_on_whole_gpus: int = 0
    memory_committed_gib: float = 0.0
    memory_of_gpus_used_gib: float = 0.0
    ways: dict[str, int] = field(default_factory=dict)
    """Pods per allocated (sub-)request name (``gpu``, ``gpu/mig-dra``, ...)."""
    pending_kinds: dict[str, int] = field(default_factory=dict)
    """Pods left Pending, per kind of ask."""
    inventory_agrees: bool = False
    seconds: float = 0.0
    round: int = 1


def _pod(name: str, ns: str, ask: Ask, arm: str, template: str = "") -> dict[str, Any]:
    container: dict[str, Any] = {"name": "server", "image": "registry.k8s.io/pause:3.10", "resources": {}}
    spec: dict[str, Any] = {"containers": [container]}
    if arm == "whole":
        annotations, container["resources"]["limits"] = {"gatekeeper.dev/gpu-mode": "dra"}, {"nvidia.com/gpu": "1"}
    elif arm == "today-shared":
        annotations = {"gatekeeper.dev/gpu-mode": "off"}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
        container["resources"]["claims"] = [{"name": "gpu"}]
    else:
        annotations = dict(ask.annotations)
        container["resources"]["limits"] = dict(ask.limits or {"nvidia.com/gpu": "1"})
    return {"apiVersion": "v1", "kind": "Pod", "spec": spec, "metadata": {
        "name": name, "namespace": ns, "labels": {"app": "inference", "ask": ask.kind}, "annotations": annotations}}


def _today_template(ns: str, gib: int) -> dict[str, Any]:
    """The claim template 79209ad's shared mode wrote for ``gib``: memory asked, nothing selected."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": f"today-shared-{gib}", "namespace": ns},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1,
                "capacity": {"requests": {"memory": f"{gib * 1024}Mi"}}}}]}}}}


def _exclusive_whole(result: dict[str, Any], device: dict[str, Any]) -> bool:
    kind = ((device.get("attributes") or {}).get("type") or {}).get("string")
    return kind == "gpu" and not device.get("allowMultipleAllocations") and not result.get("consumedCapacity")


def _count(c: Any, arm: Arm, pods: list[dict[str, Any]], ns: str, state: SandboxState) -> None:
    slices = c.get("resourceslices")["items"]
    claims = c.get("resourceclaims", "-n", ns)["items"]
    devices = {(s["spec"]["pool"]["name"], d["name"]): d for s in slices for d in s["spec"].get("devices", [])}
    by_name = {cl["metadata"]["name"]: cl for cl in claims}
    for p in pods:
        if not p["spec"].get("nodeName"):
            arm.pending += 1
            kind = p["metadata"]["labels"]["ask"]
            arm.pending_kinds[kind] = arm.pending_kinds.get(kind, 0) + 1
            continue
        arm.placed += 1
        for st in p.get("status", {}).get("resourceClaimStatuses") or []:
            alloc = (by_name.get(st.get("resourceClaimName", "")) or {}).get("status", {}).get("allocation") or {}
            for r in alloc.get("devices", {}).get("results", []):
                arm.ways[r["request"]] = arm.ways.get(r["request"], 0) + 1
                if (p["metadata"]["labels"]["ask"] in SHARE_KINDS
                        and _exclusive_whole(r, devices.get((r["pool"], r["device"]), {}))):
                    arm.share_asks_on_whole_gpus += 1
    rows = gpu_rows(slices, claims)
    used = [r for r in rows if not r.idle]
    arm.gpus_total, arm.gpus_used = len(rows), len(used)
    arm.memory_committed_gib = sum(r.memory_committed for r in used) / GIB
    arm.memory_of_gpus_used_gib = sum(r.memory_capacity for r in used) / GIB
    arm.inventory_agrees = _inventory_agrees(state, rows)


def _inventory_agrees(state: SandboxState, rows: list[Any], timeout: float = 30) -> bool:
    """The webhook's gatekeeper_gpu_* series give the same per-GPU claims and committed memory."""
    import ssl
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(Path(state.certs_dir) / "ca.crt"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(state.extra["webhook"]["url"] + "/metrics", context=ctx, timeout=10) as resp:
            page = resp.read().decode()
        if all(metric_sum(page, "gatekeeper_gpu_claims", node=r.node, gpu=r.gpu) == len(r.claims)
               and metric_sum(page, "gatekeeper_gpu_memory_committed_bytes", node=r.node, gpu=r.gpu)
               == r.memory_committed for r in rows):
            return True
        time.sleep(1)
    return False


def run_arm(c: Any, state: SandboxState, name: str, pod_asks: list[Ask], timeout: float = 300) -> Arm:
    from loadtest.gpu_packing import _settled, wait_claims_gone

    ns = f"mixed-{name}-{uuid.uuid4().hex[:6]}"
    c.run("create", "namespace", ns)
    deadline = time.monotonic() + 60
    while c.run("get", "serviceaccount", "default", "-n", ns, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {ns}: no default ServiceAccount")
        time.sleep(0.3)
    arm, started = Arm(name, len(pod_asks)), time.monotonic()
    try:
        items = []
        if name == "today-shared":
            items += [_today_template(ns, g) for g in sorted({a.today_gib for a in pod_asks})]
        items += [_pod(f"srv-{i}", ns, a, name, f"today-shared-{a.today_gib}") for i, a in enumerate(pod_asks)]
        c.run("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        deadline = time.monotonic() + timeout
        while not _settled(pods := c.get("pods", "-n", ns)["items"], len(pod_asks)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: pods not settled after {timeout:.0f}s")
            time.sleep(1)
        arm.seconds = time.monotonic() - started
        _count(c, arm, pods, ns, state)
    finally:
        c.run("delete", "namespace", ns, "--wait=false", check=False)
        wait_claims_gone(c, ns)
    return arm


ARMS = ("whole", "today-shared", "asks")


def run(state: SandboxState, seed: int = 44, rounds: int = 1) -> list[Arm]:
    """Every arm once per round, interleaved (whole, today-shared, asks, whole, ...): the scheduler's order of
    pods differs between runs, so a count can move by a pod or two; rounds show by how much."""
    from loadtest.gpu_packing import Cluster

    c, pod_asks = Cluster(state), asks(seed)
    out = []
    for r in range(rounds):
        for name in ARMS:
            arm = run_arm(c, state, name, pod_asks)
            arm.round = r + 1
            out.append(arm)
    return out


def table(arms: list[Arm]) -> str:
    rows = ["| arm | round | pods placed | Pending | GPUs used (of all) | share asks holding a whole exclusive GPU | "
            "memory committed / memory of GPUs used | inventory metrics agree |", "|---|---|---|---|---|---|---|---|"]
    for a in sorted(arms, key=lambda a: (ARMS.index(a.name), a.round)):
        used = a.memory_committed_gib / a.memory_of_gpus_used_gib if a.memory_of_gpus_used_gib else 0.0
        rows.append(f"| {a.name} | {a.round} | {a.placed}/{a.pods} | {a.pending} | {a.gpus_used} ({a.gpus_total}) | "
                    f"{a.share_asks_on_whole_gpus} | {a.memory_committed_gib:.0f} / {a.memory_of_gpus_used_gib:.0f} "
                    f"GiB ({used:.0%}) | {'yes' if a.inventory_agrees else 'NO'} |")
    return "\n".join(rows)


def write_report(out: Path, arms: list[Arm], state: SandboxState, prov: dict[str, str], seed: int, rounds: int,
                 load: tuple[float, float]) -> Path:
    """``out/report.md``: provenance (commit, command, fleet, machine load), the table, and each arm's ways."""
    out.mkdir(parents=True, exist_ok=True)
    ways = "\n".join(f"- {a.name} round {a.round}: " + ", ".join(f"{k} {v}" for k, v in sorted(a.ways.items()))
                     + "; Pending: " + (", ".join(f"{k} {v}" for k, v in sorted(a.pending_kinds.items())) or "none")
                     for a in arms)
    fleet = ", ".join(f"{p['name']} ({len(p['nodes'])} x {p['gpus']} {p['model']}, sharing {p['sharing']})"
                      for p in state.extra["gpu_pools"])
    seconds = ", ".join(f"{a.name} {a.seconds:.0f}" for a in arms)
    text = (f"# GPU packing on the mixed fleet: 48 pods with mixed asks\n\n## Provenance\n\n"
            f"- git commit: {prov['git commit']} (tree {prov['tree']})\n"
            f"- command: `python -m loadtest bench gpu-packing --state-dir DIR --out {out} --rounds {rounds}` "
            f"(seed {seed}) on `gatekeeper sandbox up --state-dir DIR --apiservers 1 --mixed-fleet --with-scheduler "
            f"--with-webhook` (kube-apiserver, kube-scheduler, kube-controller-manager v1.37.2; KWOK nodes)\n"
            f"- fleet: {fleet}; {', '.join(state.extra.get('mig_dra_nodes') or [])} (3 x H100-80GB, dynamic MIG)\n"
            f"- machine: {platform.node()}, {os.cpu_count()} cores, shared with other engineers' runs; load average "
            f"{load[0]:.2f} before, {load[1]:.2f} after (placements are counts, not timings: load does not change "
            f"them)\n\n## Result\n\n{table(arms)}\n\nAllocated (sub-)requests and Pending asks:\n\n{ways}\n\n"
            f"Seconds from create to settled: {seconds}\n\n## The pods and the arms\n\n"
            + (__doc__ or "").split("\n\n", 2)[2])
    path = out / "report.md"
    path.write_text(text)
    return path
