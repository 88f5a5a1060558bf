"""GPU packing: the same inference pods as whole-GPU pods and in ``shared`` mode, side by side.

    gatekeeper sandbox up --state-dir .sandbox --apiservers 1 --gpu-nodes 4 --with-scheduler \\
        --with-webhook --gpu-sharing memory
    .venv/bin/python loadtest/gpu_packing.py --state-dir .sandbox --pods 24 --png packing.png

The seeds' inference fleet idles at 12-30% GPU utilization because every
serving pod takes a whole GPU. This turns that into a number: M pods asking
for ``nvidia.com/gpu: 1`` with a ``gatekeeper.dev/gpu-memory`` of 10-20 GiB
(fixed seed) go through the real webhook and the real kube-scheduler twice:

* ``whole``: gpu-mode ``dra``, one exclusive GPU per pod (what the device
  plugin gives);
* ``shared``: gpu-mode ``shared``, a claim asking for the pod's memory as
  DRA consumable capacity, so several pods share one GPU.

For each arm it reports the pods placed, the GPUs they hold (distinct devices
in the claims' allocation results), and the memory utilization of those GPUs
(pods' memory / memory of the GPUs they hold). "Utilization" here is memory
committed, not SM activity: the sandbox's GPUs run nothing. Prints a table
and, with matplotlib installed (the ``loadtest`` extra), writes a PNG.

On a ``--mixed-fleet`` sandbox it runs loadtest/gpu_mixed_packing.py instead: 48 pods with mixed asks, whole
GPUs against today's shared claim against the asks through the webhook, counted with the GPU inventory's own
function and checked against its metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatekeeper.sandbox import kubectl
from gatekeeper.sandbox.state import SandboxState

GIB = 1024**3
ARMS = (("whole", "dra"), ("shared", "shared"))


@dataclass
class ArmResult:
    """What one arm placed and what it cost."""

    arm: str
    pods: int
    placed: int = 0
    gpus_used: int = 0
    gpu_memory_gib: float = 0.0
    pod_memory_gib: float = 0.0
    seconds: float = 0.0
    per_gpu: dict[str, float] = field(default_factory=dict)
    """Pod memory (GiB) committed on each GPU held (``pool/device``)."""

    @property
    def utilization(self) -> float:
        return self.pod_memory_gib / self.gpu_memory_gib if self.gpu_memory_gib else 0.0


def pod_sizes(count: int, seed: int = 7, low: int = 10, high: int = 20) -> list[int]:
    """GiB per pod, uniform in [low, high], reproducible."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


def _pod(name: str, ns: str, mode: str, gib: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": "inference"},
                         "annotations": {"gatekeeper.dev/gpu-mode": mode, "gatekeeper.dev/gpu-memory": f"{gib}Gi"}},
            "spec": {"containers": [{"name": "server", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


class Cluster:
    """kubectl against one sandbox (admin kubeconfig)."""

    def __init__(self, state: SandboxState) -> None:
        self.kubeconfig = state.kubeconfig
        self.binary = state.extra.get("kubectl")

    def run(self, *args: str, input: str | None = None, check: bool = True) -> Any:
        return kubectl.run(self.kubeconfig, *args, input=input, binary=self.binary, check=check, timeout=120)

    def get(self, *args: str) -> Any:
        return kubectl.get_json(self.kubeconfig, *args, binary=self.binary, timeout=120)


def _device_memory(c: Cluster) -> dict[str, int]:
    """Memory capacity (bytes) of every published GPU, keyed ``pool/device``."""
    from gatekeeper.webhook.gpu.sizing import parse_quantity_bytes

    out = {}
    for s in c.get("resourceslices")["items"]:
        for d in s["spec"].get("devices", []):
            mem = d.get("capacity", {}).get("memory", {}).get("value")
            if mem:
                out[f"{s['spec']['pool']['name']}/{d['name']}"] = parse_quantity_bytes(mem)
    return out


def _settled(pods: list[dict[str, Any]], want: int) -> bool:
    """Every pod is bound, or the scheduler has said it cannot place it (PodScheduled=False Unschedulable)."""
    if len(pods) < want:
        return False
    for p in pods:
        if p["spec"].get("nodeName"):
            continue
        conds = p.get("status", {}).get("conditions") or []
        if not any(x["type"] == "PodScheduled" and x.get("reason") == "Unschedulable" for x in conds):
            return False
    return True


def wait_claims_gone(c: Cluster, ns: str, timeout: float = 180) -> None:
    """A deleted namespace frees its GPUs only when its claims are gone (deallocated)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = c.run("get", "resourceclaims", "-n", ns, "-o", "name", check=False)
        if p.returncode == 0 and not p.stdout.strip():
            return
        time.sleep(0.5)
    raise TimeoutError(f"claims in namespace {ns} still present after {timeout:.0f}s")


def run_arm(c: Cluster, arm: str, mode: str, sizes: list[int], timeout: float = 300) -> ArmResult:
    ns = f"packing-{arm}-{uuid.uuid4().hex[:6]}"
    c.run("create", "namespace", ns)
    deadline = time.monotonic() + 60
    while c.run("get", "serviceaccount", "default", "-n", ns, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {ns}: no default ServiceAccount")
        time.sleep(0.3)
    result = ArmResult(arm, len(sizes))
    started = time.monotonic()
    try:
        items = [_pod(f"srv-{i}", ns, mode, gib) for i, gib in enumerate(sizes)]
        c.run("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        deadline = time.monotonic() + timeout
        while True:
            pods = c.get("pods", "-n", ns)["items"]
            if _settled(pods, len(sizes)):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{arm}: pods not settled after {timeout:.0f}s")
            time.sleep(0.5)
        result.seconds = time.monotonic() - started
        capacity = _device_memory(c)
        need = {p["metadata"]["name"]: sizes[int(p["metadata"]["name"].split("-")[1])] for p in pods}
        claims = {cl["metadata"]["name"]: cl for cl in c.get("resourceclaims", "-n", ns)["items"]}
        for p in pods:
            if not p["spec"].get("nodeName"):
                continue
            for st in p.get("status", {}).get("resourceClaimStatuses") or []:
                claim = claims.get(st.get("resourceClaimName", ""))
                alloc = (claim or {}).get("status", {}).get("allocation")
                if not alloc:
                    continue
                result.placed += 1
                for r in alloc["devices"]["results"]:
                    key = f"{r['pool']}/{r['device']}"
                    result.per_gpu[key] = result.per_gpu.get(key, 0.0) + need[p["metadata"]["name"]]
        result.gpus_used = len(result.per_gpu)
        result.gpu_memory_gib = sum(capacity[k] for k in result.per_gpu) / GIB
        result.pod_memory_gib = sum(result.per_gpu.values())
    finally:
        c.run("delete", "namespace", ns, "--wait=false", check=False)
        wait_claims_gone(c, ns)
    return result


def run(state: SandboxState, pods: int, seed: int = 7) -> list[ArmResult]:
    c = Cluster(state)
    sizes = pod_sizes(pods, seed)
    return [run_arm(c, arm, mode, sizes) for arm, mode in ARMS]


def table(results: list[ArmResult]) -> str:
    rows = ["| arm | pods placed | GPUs used | pod memory | memory of GPUs used | memory utilization |",
            "|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.arm} | {r.placed}/{r.pods} | {r.gpus_used} | {r.pod_memory_gib:.0f} GiB | "
                    f"{r.gpu_memory_gib:.0f} GiB | {r.utilization:.0%} |")
    return "\n".join(rows)


def plot(results: list[ArmResult], path: Path) -> bool:
    """Bar charts of GPUs used and memory utilization; False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = [r.arm for r in results]
    a.bar(names, [r.gpus_used for r in results], color=["#999999", "#76b900"])
    a.set_title("GPUs used")
    b.bar(names, [100 * r.utilization for r in results], color=["#999999", "#76b900"])
    b.set_title("memory utilization of GPUs used (%)")
    b.set_ylim(0, 100)
    fig.suptitle(f"{results[0].pods} inference pods of 10-20 GiB on 80 GiB GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, required=True,
                    help="a running sandbox (--with-webhook --with-scheduler, and --gpu-sharing memory or "
                         "--mixed-fleet)")
    ap.add_argument("--pods", type=int, default=24, help="uniform fleet: pods per arm (the mixed fleet runs 48)")
    ap.add_argument("--seed", type=int, default=None, help="pod sizes (default 7; mixed fleet 44)")
    ap.add_argument("--png", type=Path, default=None, help="uniform fleet: write the chart here")
    ap.add_argument("--out", type=Path, default=None, help="mixed fleet: write report.md (with provenance) here")
    ap.add_argument("--allow-dirty", action="store_true", help="write a report from a tree with changes")
    ap.add_argument("--rounds", type=int, default=3, help="mixed fleet: every arm this many times, interleaved")
    args = ap.parse_args(argv)
    state = SandboxState.load(args.state_dir)
    if state.extra.get("gpu_pools") and "webhook" in state.extra:
        return _mixed(state, args)
    if state.extra.get("gpu_sharing") != "memory" or "webhook" not in state.extra:
        print("the sandbox must run with --with-webhook and --gpu-sharing memory or --mixed-fleet", file=sys.stderr)
        return 2
    results = run(state, args.pods, 7 if args.seed is None else args.seed)
    print(table(results))
    if args.png:
        print(f"chart: {args.png}" if plot(results, args.png) else "matplotlib not installed: no chart")
    return 0


def _mixed(state: SandboxState, args: argparse.Namespace) -> int:
    import os

    from loadtest import gpu_mixed_packing as mixed
    from loadtest.harness.report import provenance

    try:
        prov = provenance(args.allow_dirty)
    except ValueError as exc:
        print(f"gpu-packing: {exc}", file=sys.stderr)
        return 2
    before = os.getloadavg()[0]
    seed = 44 if args.seed is None else args.seed
    arms = mixed.run(state, seed, args.rounds)
    print(mixed.table(arms))
    if args.out:
        path = mixed.write_report(args.out, arms, state, prov, seed, args.rounds, (before, os.getloadavg()[0]))
        print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
