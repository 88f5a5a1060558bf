"""Run the Locust mix straight at apiserver 1 and through the gatekeeper proxy, in one run.

Not a test: it prints aggregate requests/s, p50/p99 and failures for both targets and
gatekeeper's figures as ratios against the direct run (same machine, same minute).

    gatekeeper sandbox up --state-dir .sandbox --apiservers 3 --with-proxy
    .venv/bin/pip install -e '.[loadtest]'
    .venv/bin/python loadtest/run_locust.py --state-dir .sandbox --users 20 --seconds 30

Bounded by design: ``--seconds`` (default 30, max 300) per target and ``--users``
(default 20, max 200).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gatekeeper.sandbox.state import SandboxState

HERE = Path(__file__).resolve().parent
NAMESPACE = "gk-locust"


def kubectl(state: SandboxState, *args: str) -> None:
    subprocess.run(["kubectl", "--kubeconfig", state.kubeconfig, *args], check=False, capture_output=True)


def run_target(name: str, url: str, state: SandboxState, users: int, seconds: int, out: Path) -> dict[str, float]:
    prefix = out / name
    env = {"GK_SERVER": url, "GK_CERT_DIR": state.certs_dir, "GK_NAMESPACE": NAMESPACE}
    cmd = [
        sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "--only-summary",
        "-u", str(users), "-r", str(max(1, users // 2)), "-t", f"{seconds}s", "--csv", str(prefix),
        "--stop-timeout", "10",
    ]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=seconds + 120)
    stats = prefix.with_name(prefix.name + "_stats.csv")
    if not stats.exists():
        raise SystemExit(f"locust against {name} produced no stats (rc={proc.returncode}):\n{proc.stderr[-2000:]}")
    with stats.open() as fh:
        rows = {r["Name"]: r for r in csv.DictReader(fh)}
    agg = rows["Aggregated"]
    return {
        "rps": float(agg["Requests/s"]),
        "p50": float(agg["50%"]),
        "p99": float(agg["99%"]),
        "requests": float(agg["Request Count"]),
        "failures": float(agg["Failure Count"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", default=".sandbox")
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--seconds", type=int, default=30)
    args = ap.parse_args()
    users, seconds = min(max(args.users, 1), 200), min(max(args.seconds, 5), 300)
    state = SandboxState.load(args.state_dir)
    proxy = state.extra.get("proxy", {}).get("url")
    if not proxy:
        raise SystemExit(f"sandbox in {args.state_dir} has no proxy; start it with --with-proxy")
    kubectl(state, "create", "namespace", NAMESPACE)
    results = {}
    with tempfile.TemporaryDirectory(prefix="gk-locust-") as tmp:
        for name, url in (("direct", state.apiserver_urls[0]), ("gatekeeper", proxy)):
            results[name] = run_target(name, url, state, users, seconds, Path(tmp))
    kubectl(state, "delete", "namespace", NAMESPACE, "--wait=false")
    ref = results["direct"]
    print(f"locust mix, {users} users x {seconds}s per target")
    print(f"{'target':12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9} {'failures':>9}   ratios vs direct")
    for name, r in results.items():
        ratio = (
            f"req/s x{r['rps'] / ref['rps']:.2f}  p50 x{r['p50'] / max(ref['p50'], 1):.2f}  "
            f"p99 x{r['p99'] / max(ref['p99'], 1):.2f}"
        )
        figures = f"{r['rps']:8.1f} {r['p50']:8.0f} {r['p99']:8.0f} {r['requests']:9.0f} {r['failures']:9.0f}"
        print(f"{name:12} {figures}   {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
