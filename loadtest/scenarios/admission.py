"""``admission``: what the webhooks cost a create, end to end through the apiserver (on vs off).

The anchor is Kyverno's published figure (issue 12): 251 ms without vs 297 ms
with its policies at 500 virtual users. Here tenants create Pods and Secrets
(each deleted right after) through the apiservers, first with gatekeeper's
webhook configurations removed, then registered again; the webhook's CPU per
review comes from /proc (its whole process group) over its own
``gatekeeper_webhook_reviews_total``.

Which creates reach the webhook: Secrets (validating, every create) and GPU
pods (mutating, rewritten to DRA claims). Plain pods do not: the mutating
configuration's ``matchConditions`` keep the apiserver from calling it for pods
that ask for no ``nvidia.com/gpu``, so their "webhooks on" figure is the
apiserver's (and the machine's) cost only. An earlier version drove only plain
pods and Secrets and divided the CPU by reviews that were all Secret reviews,
about half the creates; the report now splits reviews by policy and gives the
webhook's own in-process time per route.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from gatekeeper.sandbox import kubectl
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.with_webhook import enforced
from gatekeeper.webhook import registration
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.report import Report, bar_plot
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, proc_figures, write_rows

NAME = "admission"
NS = "loadtest-admission"
CLAIM = """Admission webhooks add latency to every create. Anchor (Kyverno's published load test, quoted in
issue 12): 251 ms without vs 297 ms with policies, at 500 virtual users (+18%)."""
CONFIGS = (("validatingwebhookconfiguration", registration.VALIDATING_NAME),
           ("mutatingwebhookconfiguration", registration.MUTATING_NAME))


def _save_configs(state: SandboxState) -> list[dict[str, Any]]:
    out = []
    for kind, name in CONFIGS:
        obj = kubectl.get_json(state.kubeconfig, kind, name, binary=state.extra.get("kubectl"))
        for k in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            obj["metadata"].pop(k, None)
        out.append(obj)
    return out


def _set_webhooks(state: SandboxState, on: bool, saved: list[dict[str, Any]]) -> None:
    """Register or remove the webhooks, then wait until every apiserver agrees."""
    binary = state.extra.get("kubectl")
    if on:
        kubectl.run(state.kubeconfig, "apply", "-f", "-", binary=binary, check=True,
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": saved}))
    else:
        for kind, name in CONFIGS:
            kubectl.run(state.kubeconfig, "delete", kind, name, binary=binary, check=True)
    deadline = time.monotonic() + 120
    for kc in state.extra.get("apiserver_kubeconfigs") or [state.kubeconfig]:
        while (enforced(kc, binary)[0]) != on:
            if time.monotonic() > deadline:
                raise ScenarioError(f"webhooks still {'off' if on else 'on'} on {kc} after 120s")
            time.sleep(0.5)


KINDS = ("CREATE pod", "CREATE gpu pod", "CREATE secret")
ROUTES = (("validate", "secret-size"), ("mutate", "gpu"))
"""The webhook's routes and the review policy each answers."""


def _reviews(url: str, ca: Path) -> dict[str, float]:
    """Reviews in total and by policy, and the webhook's own time per route (histogram sum and count)."""
    with httpx.Client(verify=cluster.tls(ca), timeout=10) as c:
        text = c.get(url).text
    out = {"total": kit.metric_sum(text, "gatekeeper_webhook_reviews_total")}
    for route, policy in ROUTES:
        out[policy] = kit.metric_sum(text, "gatekeeper_webhook_reviews_total", policy=policy)
        out[f"{route}_sum"] = kit.metric_sum(text, "gatekeeper_webhook_review_duration_seconds_sum", route=route)
        out[f"{route}_count"] = kit.metric_sum(text, "gatekeeper_webhook_review_duration_seconds_count",
                                               route=route)
    return out


def _per(seconds: float, count: float) -> str:
    return f"{seconds / count * 1000:.2f}" if count else "n/a"


def run(ctx: RunContext) -> None:
    users, duration = ctx.n(50, 2), max(15.0, 120 * ctx.scale)
    report = Report(ctx.out, "admission: create latency with gatekeeper's webhooks on vs off", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, addons=("webhook",)) as state:
        if "webhook" not in state.extra:
            raise ScenarioError("the sandbox has no webhook add-on (sandbox up --with-webhook)")
        report.use_sandbox(state)
        ca = SandboxPKI(Path(state.certs_dir)).ca
        identities = cluster.tenants(state, NS, min(users, 10), ctx.work)
        with cluster.admin(state) as c:
            c.post(f"/api/v1/namespaces/{NS}/serviceaccounts",
                   json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        saved = _save_configs(state)
        hook = state.process("webhook")
        metrics_url = hook.urls["metrics"]
        for arm, enable in (("webhooks-off", False), ("webhooks-on", True)):
            _set_webhooks(state, enable, saved)
            sampler = Sampler(state, arm, interval=1.0, extra_pids={"webhook": hook.pid})
            spec = {"user_classes": ["loadtest.harness.users:AdmissionUser"], "users": users,
                    "spawn_rate": max(1, users // 5), "run_time": duration, "targets": state.apiserver_urls,
                    "identities": identities, "namespace": NS, "ca": str(ca), "request_timeout": 60}
            cpu0, rev0 = (proc_figures(hook.pid) or (0, 0.0))[1], _reviews(metrics_url, ca)
            with sampler:
                rows = run_locust(ctx, arm, spec, timeout=duration)
            cpu1, rev1 = (proc_figures(hook.pid) or (0, 0.0))[1], _reviews(metrics_url, ca)
            samplers.append(sampler)
            delta = {k: rev1[k] - rev0[k] for k in rev1}
            results.append({"arm": arm, "rows": rows, "cpu": cpu1 - cpu0, "reviews": delta["total"], "by": delta})
            ctx.say(f"  {arm}: {ms(rows.get('Aggregated'), 'Requests/s'):.1f} req/s, {delta['total']:.0f} reviews")
    write_rows(ctx.out / "samples.csv", samplers)
    report.csvs += ["samples.csv", *[f"{r['arm']}_stats.csv" for r in results]]
    report.setup["load"] = (f"{users} Locust users (Kyverno's test used 500 VUs on a real cluster), each "
                            f"creating a Pod or a 1 KiB Secret and deleting it, {duration:.0f} s per arm, "
                            "tenants (client certificates and ServiceAccount tokens) spread over 3 apiservers")
    table = []
    for r in results:
        for name in KINDS:
            row = r["rows"].get(name)
            table.append([r["arm"], name, ms(row, "Average Response Time"), ms(row, "50%"), ms(row, "99%"),
                          ms(row, "Requests/s"), int(ms(row, "Failure Count"))])
    report.table(["arm", "request", "mean ms", "p50 ms", "p99 ms", "req/s", "failed"], table)
    on = results[-1]
    per_review = on["cpu"] / on["reviews"] * 1000 if on["reviews"] else float("nan")
    by = on["by"]
    creates = {n: int(ms(on["rows"].get(n), "Request Count")) for n in KINDS}
    report.text(f"Webhook CPU with the webhooks on: {on['cpu']:.2f} CPU-s for {on['reviews']:.0f} reviews = "
                f"**{per_review:.2f} ms CPU per review** (whole process group, /proc, over Secret and GPU pod "
                "reviews together).")
    report.table(["policy (route)", "reviews", "creates sent by Locust", "webhook's own time per review ms"],
                 [["secret-size (/validate)", int(by["secret-size"]), f"{creates['CREATE secret']} Secrets",
                   _per(by["validate_sum"], by["validate_count"])],
                  ["gpu (/mutate)", int(by["gpu"]), f"{creates['CREATE gpu pod']} GPU pods",
                   _per(by["mutate_sum"], by["mutate_count"])],
                  ["none: plain pods", 0, f"{creates['CREATE pod']} pods",
                   "never sent: matchConditions ask for nvidia.com/gpu"]],
                 title="Which creates the webhooks review (webhooks on)")
    off_pod, on_pod = results[0]["rows"].get("CREATE gpu pod"), on["rows"].get("CREATE gpu pod")
    off_ms, on_ms = ms(off_pod, "Average Response Time"), ms(on_pod, "Average Response Time")
    report.seed_vs_ours += [
        ("create latency, webhooks off -> on (mean)", "251 ms -> 297 ms, x1.18 (Kyverno, 500 VUs)",
         f"{off_ms:.0f} ms -> {on_ms:.0f} ms, x{on_ms / off_ms:.2f} ({users} users, GPU pods, which the "
         "mutating webhook rewrites)"),
        ("webhook CPU per review (Secret and GPU pod reviews)", "not published", f"{per_review:.2f} ms"),
    ]
    bar_plot(report.plot("create_latency.png", "Mean create latency per arm and kind"), "Mean create latency",
             "ms", {f"{r['arm']}\n{n}": ms(r["rows"].get(n), "Average Response Time")
                    for r in results for n in KINDS})
    report.write()
