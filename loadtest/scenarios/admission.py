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

Each arm runs two phases: first an open loop at a fixed rate of creates well under saturation (plain pods, GPU
pods and Secrets in turn, ``RateAdmissionUser``: both arms get the same creates at the same times), judged
against :data:`RATE_BOUND` for every kind (issue 42: what a create costs where the machine has headroom); then
the closed loop at saturation, as before. Each round starts with an idle window of the same length with no
traffic at all: the webhook's idle CPU (judged against :data:`IDLE_BOUND`) and the baseline its CPU per review
is taken from. Its CPU while the other arm runs (others' creates, no reviews) is reported too: it watches every
pod of the cluster.

``--arms``/``--runs N`` run the two arms interleaved N times (off, on, off, on, ...). Every ratio is taken
within a round, and plain pods, which the webhook never sees, are the round's control: a kind's ratio over the
plain pods' is the webhooks' own share, judged over every round against :data:`OWN_BOUND`.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Sequence
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
from loadtest.harness.rounds import bound_verdict, interleave, run_label, spread
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, proc_figures, write_rows
from loadtest.scenarios import admission_floor as floor

NAME = "admission"
NS = "loadtest-admission"
CLAIM = """Admission webhooks add latency to every create. Anchor (Kyverno's published load test, quoted in
issue 12): 251 ms without vs 297 ms with policies, at 500 virtual users (+18%)."""
ARMS = ("webhooks-off", "webhooks-noop", "webhooks-on")
"""Off, a webhook that decides nothing where gatekeeper's are (the floor: admission_floor.py), gatekeeper's."""
OWN_BOUND = 1.25
"""The webhooks' own cost on a create they review, as a ratio over the plain pods' in the same round: at most
this in every round (Kyverno's published x1.18 with room for a shared 2-core machine), fixed before the runs."""
RATE_BOUND = 1.10
"""Mean create latency with the webhooks over without, per kind, at the fixed rate: at most this in every round
(issue 42's done-when), fixed before the runs."""
IDLE_BOUND = 1.0
"""The webhook's CPU with no traffic at all, % of one core: below this in every round (issue 42)."""
RATE = 30.0
"""Creates per second (all kinds) of the fixed-rate phase at --scale >= 0.5: about a third of what the 2-core
machine's apiservers take closed loop with the webhooks off (~80/s, loadtest/reports/admission/)."""
PHASES = ("rate", "saturation")
COMPARISONS = (("webhooks-on", "webhooks-off"), ("webhooks-noop", "webhooks-off"), ("webhooks-on", "webhooks-noop"))
"""(arm, baseline) pairs reported: the whole cost, the floor of calling any webhook, gatekeeper's over the floor."""
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


def _set_webhooks(state: SandboxState, arm: str, saved: list[dict[str, Any]], noop_url: str | None) -> None:
    """Register gatekeeper's webhooks, the noop twins or none, then wait until every apiserver agrees."""
    binary = state.extra.get("kubectl")
    for kind, name in CONFIGS:
        kubectl.run(state.kubeconfig, "delete", kind, name, "--ignore-not-found", binary=binary, check=True)
    items = saved if arm == "webhooks-on" else []
    if arm == "webhooks-noop":
        items = floor.noop_configs(saved, noop_url or "")
    if items:
        kubectl.run(state.kubeconfig, "apply", "-f", "-", binary=binary, check=True,
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    deadline = time.monotonic() + 120
    for kc in state.extra.get("apiserver_kubeconfigs") or [state.kubeconfig]:
        while (enforced(kc, binary)[0] != (arm == "webhooks-on")
               or floor.noop_answers(state, kc) != (arm == "webhooks-noop")):
            if time.monotonic() > deadline:
                raise ScenarioError(f"{arm}: the apiserver behind {kc} still calls other webhooks after 120s")
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


def _phase(results: Sequence[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [r for r in results if r.get("phase", "saturation") == phase]


def ratios(results: Sequence[dict[str, Any]], phase: str = "saturation", on_arm: str = "webhooks-on",
           off_arm: str = "webhooks-off") -> dict[str, list[float]]:
    """Per kind, each round's mean create latency in ``on_arm`` over ``off_arm``; ``own <kind>``: that ratio over
    the plain pods' in the same round (the machine's drift taken out). Rounds without both arms are skipped."""
    means: dict[tuple[int, str], dict[str, float]] = {}
    for r in _phase(results, phase):
        means[(r["round"], r["arm"])] = {n: ms(r["rows"].get(n), "Average Response Time") for n in KINDS}
    out: dict[str, list[float]] = {}
    for round_ in sorted({rnd for rnd, _ in means}):
        off, on = means.get((round_, off_arm)), means.get((round_, on_arm))
        if not off or not on:
            continue
        each = {n: on[n] / off[n] for n in KINDS if off[n] > 0}
        for n, v in each.items():
            out.setdefault(n, []).append(v)
            if n != "CREATE pod" and each.get("CREATE pod"):
                out.setdefault(f"own {n}", []).append(v / each["CREATE pod"])
    return out


def added_ms(results: Sequence[dict[str, Any]], phase: str, on_arm: str = "webhooks-on",
             off_arm: str = "webhooks-off") -> dict[str, list[float]]:
    """Per kind, each round's mean create latency in ``on_arm`` minus ``off_arm``, ms."""
    means = {(r["round"], r["arm"]): r["rows"] for r in _phase(results, phase)}
    out: dict[str, list[float]] = {}
    for (round_, arm), rows in sorted(means.items()):
        off = means.get((round_, off_arm))
        if arm != on_arm or off is None:
            continue
        for n in KINDS:
            out.setdefault(n, []).append(ms(rows.get(n), "Average Response Time") - ms(off.get(n),
                                                                                        "Average Response Time"))
    return out


def cpu_per_review(results: Sequence[dict[str, Any]], idle: dict[int, float], phase: str) -> list[float]:
    """Per round, ms of webhook CPU per review with the webhooks on, less the idle baseline (CPU-s per s of the
    round's idle window) over the same length."""
    out = []
    for r in _phase(results, phase):
        if r["arm"] == "webhooks-on" and r["reviews"] and r["round"] in idle:
            out.append((r["cpu"] - idle[r["round"]] * r["wall"]) / r["reviews"] * 1000)
    return out


def _idle(pid: int, seconds: float) -> float:
    """The webhook's CPU-s per s over ``seconds`` with no traffic (webhooks registered or not: nothing creates)."""
    cpu0, t0 = (proc_figures(pid) or (0, 0.0))[1], time.monotonic()
    time.sleep(seconds)
    return ((proc_figures(pid) or (0, 0.0))[1] - cpu0) / (time.monotonic() - t0)


def _measure(ctx: RunContext, state: SandboxState, pid: int, metrics_url: str, ca: Path, label: str,
             spec: dict[str, Any], duration: float, samplers: list[Sampler], names: list[str]) -> dict[str, Any]:
    """One Locust run: its stats rows, the webhook's CPU, reviews and wall time over it, and every webhook call
    as the apiservers timed it."""
    sampler = Sampler(state, label, interval=1.0, extra_pids={"webhook": pid})
    calls0 = floor.webhook_calls(state, names)
    cpu0, rev0 = (proc_figures(pid) or (0, 0.0))[1], _reviews(metrics_url, ca)
    load0, gen0, t0 = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    with sampler:
        rows = run_locust(ctx, label, spec, timeout=duration)
    wall, gen1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1, rev1 = (proc_figures(pid) or (0, 0.0))[1], _reviews(metrics_url, ca)
    calls1 = floor.webhook_calls(state, names)
    samplers.append(sampler)
    delta = {k: rev1[k] - rev0[k] for k in rev1}
    return {"rows": rows, "cpu": cpu1 - cpu0, "wall": wall, "reviews": delta["total"], "by": delta,
            "load": (load0, os.getloadavg()[0]), "calls": floor.calls_between(calls0, calls1),
            "generator_cpu": (gen1.ru_utime - gen0.ru_utime) + (gen1.ru_stime - gen0.ru_stime)}


def run(ctx: RunContext) -> None:
    users, duration = ctx.n(50, 2), max(15.0, 120 * ctx.scale)
    rate = max(3.0, min(RATE, RATE * ctx.scale * 2))
    rate_users = max(3, round(rate / 3))  # creates in flight: ~0.1 s each at this rate, 1 s of slack
    arms = list(ctx.arms or ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ScenarioError(f"unknown arms {', '.join(unknown)}; known: {', '.join(ARMS)}")
    report = Report(ctx.out, "admission: create latency with gatekeeper's webhooks on vs off", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        state = stack.enter_context(cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, addons=("webhook",)))
        if "webhook" not in state.extra:
            raise ScenarioError("the sandbox has no webhook add-on (sandbox up --with-webhook)")
        report.use_sandbox(state)
        ca = SandboxPKI(Path(state.certs_dir)).ca
        identities = cluster.tenants(state, NS, min(users, 10), ctx.work)
        with cluster.admin(state) as c:
            c.post(f"/api/v1/namespaces/{NS}/serviceaccounts",
                   json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        saved = _save_configs(state)
        names = floor.webhook_names(saved)
        noop_url = stack.enter_context(floor.noop_server(state, ctx.work)) if "webhooks-noop" in arms else None
        hook = state.process("webhook")
        metrics_url = hook.urls["metrics"]
        idle: dict[int, float] = {}
        for round_, arm in interleave(arms, ctx.runs):
            if round_ not in idle:
                idle[round_] = _idle(hook.pid, duration)
                ctx.say(f"  round {round_} idle: webhook {100 * idle[round_]:.2f} % of a core")
            _set_webhooks(state, arm, saved, noop_url)
            for phase in PHASES:
                label = run_label(arm if phase == "saturation" else f"{arm}-rate", round_, ctx.runs)
                spec = {"users": users, "spawn_rate": max(1, users // 5)} if phase == "saturation" else \
                    {"user_classes": ["loadtest.harness.users:RateAdmissionUser"], "rate": rate,
                     "users": rate_users, "spawn_rate": rate_users}
                spec = {"user_classes": ["loadtest.harness.users:AdmissionUser"], "run_time": duration,
                        "targets": state.apiserver_urls, "identities": identities, "namespace": NS, "ca": str(ca),
                        "request_timeout": 60, **spec}
                r = _measure(ctx, state, hook.pid, metrics_url, ca, label, spec, duration, samplers, names)
                results.append({"arm": arm, "phase": phase, "label": label, "round": round_, **r})
                ctx.say(f"  {label}: {ms(r['rows'].get('Aggregated'), 'Requests/s'):.1f} req/s, "
                        f"{r['reviews']:.0f} reviews")
        if ctx.adopt:  # leave an adopted sandbox as it was handed over
            _set_webhooks(state, "webhooks-on", saved, noop_url)
    write_rows(ctx.out / "samples.csv", samplers)
    report.csvs += ["samples.csv", *[f"{r['label']}_stats.csv" for r in results]]
    report.setup["load"] = (f"fixed rate: {rate:g} creates/s open loop ({rate_users} Locust users in flight), a "
                            f"plain pod, a GPU pod and a 1 KiB Secret in turn; saturation: {users} Locust users "
                            "(Kyverno's test used 500 VUs on a real cluster), each creating a Pod or a 1 KiB Secret "
                            f"and deleting it; {duration:.0f} s per phase and for each round's idle window, tenants "
                            "(client certificates and ServiceAccount tokens) spread over 3 apiservers")
    report.setup["runs"] = (f"{ctx.runs} per arm, interleaved (idle, then {', '.join(arms)}, per round), each arm "
                            "at the fixed rate then at saturation, on one sandbox; webhooks-noop is Go's "
                            "noopwebhook (gatekeeper/sandbox/gomod/informers/noopwebhook) in gatekeeper's places")
    _write_report(report, results, idle, users)


def _latency_tables(report: Report, results: list[dict[str, Any]]) -> None:
    table = []
    for r in results:
        for name in KINDS:
            row = r["rows"].get(name)
            table.append([r["label"], name, ms(row, "Average Response Time"), ms(row, "50%"), ms(row, "99%"),
                          ms(row, "Requests/s"), int(ms(row, "Failure Count"))])
    report.table(["run", "request", "mean ms", "p50 ms", "p99 ms", "req/s", "failed"], table)
    report.table(["order", "run", "load (1 min) before -> after", "load generator CPU s", "webhook CPU % of a core",
                  "ramp lag p99 ms"],
                 [[i, r["label"], f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}", f"{r['generator_cpu']:.1f}",
                   f"{100 * r['cpu'] / r['wall']:.2f}" if r.get("wall") else "n/a",
                   ms(r["rows"].get("ramp lag"), "99%") if r.get("phase") == "rate" else "closed loop"]
                  for i, r in enumerate(results, 1)], "Runs in the order run")
    for phase in PHASES:
        for on_arm, off_arm in COMPARISONS:
            got, added = ratios(results, phase, on_arm, off_arm), added_ms(results, phase, on_arm, off_arm)
            vs = f"{on_arm.removeprefix('webhooks-')} / {off_arm.removeprefix('webhooks-')}"
            if got:
                report.table([f"{phase}: mean create latency, {vs} in the same round", "rounds", "median [min-max]"],
                             [[n, len(v), spread(v).show(".2f", "x")] for n, v in got.items()],
                             f"Ratios per round ({phase}, {vs}); own: over the plain pods' ratio of the same round "
                             "(no webhook sees them)")
            if added:
                report.table([f"{phase}: latency added per create, {vs.replace('/', '-')}", "rounds",
                              "median [min-max] ms"], [[n, len(v), spread(v).show(".1f")] for n, v in added.items()])
    calls = [[r["label"], name, f"{mean:.2f}", int(n)] for r in results for name, (mean, n) in r["calls"].items()]
    if calls:
        report.table(["run", "webhook", "mean ms per call", "calls"], calls,
                     "Webhook calls as the apiservers time them (apiserver_admission_webhook_admission_duration_"
                     "seconds, all apiservers): the call alone, without the rest of the create")


def _verdicts(results: list[dict[str, Any]], idle: dict[int, float]) -> list[str]:
    lines = [f"- at the fixed rate, a {n.removeprefix('CREATE ')} create through the webhooks takes at most "
             f"x{RATE_BOUND} of its latency without them in every round: **{bound_verdict(v, RATE_BOUND)}**: "
             f"{spread(v).show('.2f', 'x')}"
             for n, v in ratios(results, "rate").items() if not n.startswith("own ")]
    lines += [f"- at the fixed rate, a {n.removeprefix('CREATE ')} create through a webhook that decides nothing "
              f"takes at most x{RATE_BOUND} of its latency without webhooks in every round (is the bound above "
              f"reachable at all here?): **{bound_verdict(v, RATE_BOUND)}**: {spread(v).show('.2f', 'x')}"
              for n, v in ratios(results, "rate", "webhooks-noop").items()
              if not n.startswith("own ") and n != "CREATE pod"]
    lines += [f"- at saturation, the webhooks' own cost on a {n.removeprefix('own CREATE ')} create is at most "
              f"x{OWN_BOUND} in every round: **{bound_verdict(v, OWN_BOUND)}**: {spread(v).show('.2f', 'x')}"
              for n, v in ratios(results).items() if n.startswith("own ")]
    if idle:
        pct = [100 * v for v in idle.values()]
        lines.append(f"- the webhook's idle CPU is under {IDLE_BOUND:g} % of a core in every round: "
                     f"**{bound_verdict(pct, IDLE_BOUND)}**: {spread(pct).show('.2f') + ' %'}")
    return lines


def _write_report(report: Report, results: list[dict[str, Any]], idle: dict[int, float], users: int) -> None:
    _latency_tables(report, results)
    lines = _verdicts(results, idle)
    if lines:
        report.text("### Verdicts\n\nThe thresholds are fixed in `loadtest/scenarios/admission.py` before the runs; "
                    "a bound holds only when every round keeps it.\n\n" + "\n".join(lines))
    sat = _phase(results, "saturation")
    on = [r for r in sat if r["arm"] == "webhooks-on"][-1] if any(r["arm"] == "webhooks-on" for r in sat) \
        else sat[-1]
    base = idle.get(on["round"], 0.0) * on.get("wall", 0.0)
    per_review = (on["cpu"] - base) / on["reviews"] * 1000 if on["reviews"] else float("nan")
    rate_cpu = cpu_per_review(results, idle, "rate")
    off_cpu = [100 * r["cpu"] / r["wall"] for r in results if r["arm"] == "webhooks-off" and r.get("wall")
               and r.get("phase") == "rate"]
    report.text(f"Webhook CPU with the webhooks on (saturation, last round): {on['cpu']:.2f} CPU-s for "
                f"{on['reviews']:.0f} reviews, less {base:.2f} CPU-s of idle baseline over the same length = "
                f"**{per_review:.2f} ms CPU per review** (whole process group, /proc, over Secret and GPU pod "
                "reviews together). At the fixed rate: "
                f"{spread(rate_cpu).show('.2f') + ' ms' if rate_cpu else 'n/a'} per review; idle: "
                f"{spread([100 * v for v in idle.values()]).show('.2f') + ' %' if idle else 'n/a'} of a core; with "
                "the webhooks off at the fixed rate (others' creates, no reviews: the pod watch): "
                f"{spread(off_cpu).show('.2f') + ' %' if off_cpu else 'n/a'} of a core.")
    by = on["by"]
    creates = {n: int(ms(on["rows"].get(n), "Request Count")) for n in KINDS}
    report.table(["policy (route)", "reviews", "creates sent by Locust", "webhook's own time per review ms"],
                 [["secret-size (/validate)", int(by["secret-size"]), f"{creates['CREATE secret']} Secrets",
                   _per(by["validate_sum"], by["validate_count"])],
                  ["gpu (/mutate)", int(by["gpu"]), f"{creates['CREATE gpu pod']} GPU pods",
                   _per(by["mutate_sum"], by["mutate_count"])],
                  ["none: plain pods", 0, f"{creates['CREATE pod']} pods",
                   "never sent: matchConditions ask for nvidia.com/gpu"]],
                 title="Which creates the webhooks review (webhooks on, saturation)")
    gpu, gpu_rate = ratios(results).get("CREATE gpu pod", []), ratios(results, "rate").get("CREATE gpu pod", [])
    report.seed_vs_ours += [
        ("create latency, webhooks off -> on (mean)", "not in the seeds; other reference: 251 ms -> 297 ms, x1.18 "
         "(Kyverno, 500 VUs)",
         f"{spread(gpu).show('.2f', 'x') if gpu else 'n/a'} over {len(gpu)} rounds at saturation ({users} users), "
         f"{spread(gpu_rate).show('.2f', 'x') if gpu_rate else 'n/a'} at the fixed rate (GPU pods, which the "
         "mutating webhook rewrites)"),
        ("webhook CPU per review (Secret and GPU pod reviews)", "not published", f"{per_review:.2f} ms"),
    ]
    bar_plot(report.plot("create_latency.png", "Mean create latency per run and kind"), "Mean create latency",
             "ms", {f"{r['label']}\n{n}": ms(r["rows"].get(n), "Average Response Time")
                    for r in results for n in KINDS})
    report.write()
