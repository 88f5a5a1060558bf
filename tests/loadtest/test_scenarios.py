"""Every scenario end to end at a tiny scale: real sandbox, real Locust, a report that parses.

Scenarios are not tests of the seeds' claims (their figures need the default
scale); these check that each one runs, writes report.md with the seed's figure
beside a number of ours, CSVs whose numbers are real samples, and PNGs that are
images, and that the figures agree with what the load was (e.g. every lister's
LISTs completed, shares sum to one).
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture(scope="module")
def haproxy() -> str:
    """Debian's haproxy; installed here when missing (CI runs as root), never silently skipped."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "haproxy"], capture_output=True, timeout=600)
        if not shutil.which("haproxy", path="/usr/sbin:/usr/bin"):
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-q", "haproxy"], capture_output=True, timeout=600)
        found = shutil.which("haproxy", path="/usr/sbin:/usr/bin")
    if not found:
        pytest.fail("haproxy is needed by the list-storm and skew scenarios: apt-get install -y haproxy")
    return found


def run_scenario(name: str, out: Path, scale: float = 0.02, extra: Sequence[str] = ()) -> Path:
    """One run per arm unless ``extra`` asks for more (the reports' 3 would triple the suite's time)."""
    from loadtest.cli import ARMED

    runs = ["--runs", "1"] if name in ARMED and "--runs" not in extra else []
    # --allow-dirty: a developer runs the suite on uncommitted work; the report says so (CI's tree is clean)
    p = subprocess.run([sys.executable, "-m", "loadtest", name, "--out", str(out), "--scale", str(scale),
                        "--allow-dirty", *runs, *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return out / "report.md"


def check_report(report: Path) -> str:
    """The sections, a number of ours in every seed row, and every linked file exists and parses."""
    import matplotlib.image

    text = report.read_text()
    for section in ("## The seed's claim", "## Seed vs ours", "## Results", "## Plots", "## Setup"):
        assert section in text, section
    assert re.search(r"- machine: \d+ cores", text)
    assert re.search(r"- load average \(1/5/15 min\) before: [\d.]+ / [\d.]+ / [\d.]+", text)
    assert "Command: `" in text and "kube-apiserver: Kubernetes v" in text
    assert re.search(r"^- git commit: [0-9a-f]{40}$", text, re.M) and re.search(r"^- tree: (clean|DIRTY)", text, re.M)
    assert re.search(r"^- etcd: etcd Version: 3\.", text, re.M) and re.search(r"^- kubectl: Client Version", text, re.M)
    assert "### The load generator: Locust's own CPU per arm" in text
    assert list(report.parent.glob("*-locust.log")), "Locust's log is kept with the report"
    seed_rows = re.findall(r"^\| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", text.split("## Seed vs ours")[1]
                           .split("## Results")[0], re.M)
    ours = [r[2] for r in seed_rows if r[0] not in ("figure", "---")]
    assert ours and all(re.search(r"\d", o) for o in ours), seed_rows
    links = re.findall(r"\]\(([^)]+\.(?:png|csv))\)", text)
    assert any(link.endswith(".png") for link in links) and any(link.endswith(".csv") for link in links)
    for link in links:
        path = report.parent / link
        assert path.exists(), link
        if link.endswith(".png"):
            img = matplotlib.image.imread(path)
            assert img.shape[0] > 200 and img.shape[1] > 400 and img.std() > 0, link
        else:
            with path.open() as fh:
                assert len(list(csv.DictReader(fh))) > 0, link
    return text


def samples(out: Path) -> list[dict[str, str]]:
    with (out / "samples.csv").open() as fh:
        return list(csv.DictReader(fh))


def check_samples(out: Path, arms: list[str]) -> list[dict[str, str]]:
    rows = samples(out)
    for arm in arms:
        rss = [float(r["rss_bytes"]) for r in rows
               if r["arm"] == arm and r["component"].startswith("kube-apiserver") and r["rss_bytes"]]
        # the median, not the minimum: the gogc scenario restarts the apiservers, and a sample taken just
        # after a restart is legitimately small
        assert len(rss) >= 3 and sorted(rss)[len(rss) // 2] > 50 * MIB, (arm, rss[:5])
        heap = [float(r["heap_bytes"]) for r in rows if r["arm"] == arm and r["heap_bytes"]]
        assert heap and max(heap) > 10 * MIB, arm
    return rows


def locust_stats(out: Path, arm: str) -> dict[str, dict[str, str]]:
    with (out / f"{arm}_stats.csv").open() as fh:
        return {r["Name"]: r for r in csv.DictReader(fh)}


def test_list_storm_writes_a_report_where_every_lister_completed_in_every_arm(tmp_path: Path, haproxy: str) -> None:
    out = tmp_path / "list-storm"
    text = check_report(run_scenario("list-storm", out, scale=0.05))
    arms = ["direct", "haproxy", "gatekeeper", "gatekeeper-coalescing"]
    rows = check_samples(out, arms)
    for arm in arms:
        lst = locust_stats(out, arm)["LIST secrets"]
        assert int(lst["Request Count"]) == 2 * 2 and int(lst["Failure Count"]) == 0, (arm, lst)
        assert float(lst["50%"]) > 0
    upstream = {}
    for arm in arms:
        per: dict[str, list[float]] = {}
        for r in rows:
            if r["arm"] == arm and r["requests"]:
                per.setdefault(r["component"], []).append(float(r["requests"]))
        upstream[arm] = sum(v[-1] - v[0] for v in per.values())
    assert upstream["direct"] == 4, upstream
    assert "secrets#0" in text and "peak upstream secret LISTs" in text


def test_list_storm_informer_arms_sync_every_informer_and_compare_each_run_with_direct_of_its_kind(
        tmp_path: Path, haproxy: str) -> None:
    """Today's clients: real client-go informers, watch-lists and LISTs, run interleaved twice."""
    out = tmp_path / "list-storm-informers"
    arms = ["informers-direct-watch-list", "informers-gatekeeper-watch-list", "informers-direct-list"]
    text = check_report(run_scenario("list-storm", out, scale=0.05,
                                     extra=["--arms", ",".join([*arms, "direct"]), "--runs", "2"]))
    with (out / "runs.csv").open() as fh:
        runs = list(csv.DictReader(fh))
    assert [r["label"] for r in runs] == [f"{a}-r{i}" for i in (1, 2) for a in [*arms, "direct"]]
    for r in runs:  # two informers synced, or two Locust listers LISTed twice each
        assert int(r["ok"]) == (4 if r["arm"] == "direct" else 2) and int(r["failed"]) == 0, r
        assert float(r["upstream"]) >= (4 if r["arm"] == "direct" else 2), r  # the WATCHes or LISTs reached etcd
        if r["arm"] in ("direct", "informers-direct-watch-list", "informers-direct-list"):
            assert float(r["ratio"]) == 1.0, r
        else:  # against the direct run of its own kind and round
            assert 0 < float(r["ratio"]), r
    with (out / "informers.csv").open() as fh:
        informers = list(csv.DictReader(fh))
    assert len(informers) == 2 * 2 * len(arms)
    for row in informers:
        kinds = {item.split(":")[0] for item in row["responses"].split()}
        ok = {item.split("=")[0] for item in row["responses"].split()}
        if "watch-list-r" in row["run"]:
            assert "watch-list:200" in ok and "list" not in kinds, row
        else:
            assert "list:200" in ok and "watch-list" not in kinds, row
    assert "### Verdicts" in text and "informers-gatekeeper-watch-list" in text
    assert "| informers-gatekeeper-watch-list | 2 |" in text


def test_list_storm_oom_runs_memory_limited_apiservers_and_reports_their_kills(tmp_path: Path, haproxy: str) -> None:
    out = tmp_path / "list-storm-oom"
    arms = ["haproxy", "haproxy-kube-apf", "direct", "gatekeeper", "gatekeeper-per-apiserver", "gatekeeper-coalescing"]
    informer_arms = ["informers-haproxy-watch-list", "informers-gatekeeper-watch-list"]
    text = check_report(run_scenario("list-storm-oom", out, scale=0.02,
                                     extra=["--arms", ",".join([*arms, *informer_arms])]))
    check_samples(out, [*arms, *informer_arms])
    for arm in arms:
        lst = locust_stats(out, arm)["LIST secrets"]
        assert int(lst["Request Count"]) == 2 and int(lst["Failure Count"]) == 0, (arm, lst)
    for arm in informer_arms:  # both informers synced, by watch-list, none fell back to a LIST
        assert re.search(rf"^\| \d+ \| {arm} \| 4096 \| [\d.]+ -> [\d.]+ \| [\d.]+ \| 0 \| 0 \| - \| 0 0 0 \| 0 \| "
                         rf"[0-9 ]+ \| 2/2 \|.* \| 0 \| [0-9 ]+ \| \d+ \|$", text, re.M), arm
    assert (out / "kills.csv").read_text().splitlines()[0] == (
        "run,arm,limit_mib,seconds_from_run_start,apiserver,kind,after,evidence")
    assert "each in a memory cgroup of 4096 MiB" in text and "secrets#0" in text
    assert re.search(r"^\| \d+ \| haproxy \| 4096 \| .* \| 0 \| 0 \| - \| 0 0 0 \|", text, re.M), \
        "a tiny storm kills nothing"
    assert "### Verdicts" in text and "at 4096 MiB, gatekeeper has no failover kill" in text


def test_skew_reports_per_apiserver_shares_that_sum_to_one(tmp_path: Path, haproxy: str) -> None:
    out = tmp_path / "skew"
    check_report(run_scenario("skew", out))
    check_samples(out, ["haproxy", "gatekeeper"])
    with (out / "shares.csv").open() as fh:
        shares = list(csv.DictReader(fh))
    by: dict[tuple[str, str], float] = {}
    for r in shares:
        by[(r["arm"], r["t"])] = by.get((r["arm"], r["t"]), 0.0) + float(r["share"])
    assert {a for a, _ in by} == {"haproxy", "haproxy-goaway", "haproxy-kube-apf", "haproxy-goaway-0.02",
                                     "gatekeeper", "gatekeeper-policy"}
    assert all(abs(v - 1.0) < 0.01 for v in by.values())
    for arm in ("haproxy", "gatekeeper", "gatekeeper-policy"):
        assert float(locust_stats(out, arm)["Aggregated"]["Request Count"]) > 50
        # every client's one storm LIST of the big Secrets completed, on its own connection
        storm = locust_stats(out, arm)["LIST secrets (storm)"]
        assert int(storm["Request Count"]) >= 3 and int(storm["Failure Count"]) == 0, storm
    rows = samples(out)
    for arm in ("haproxy", "gatekeeper"):
        conns = {r["component"]: int(r["connections"]) for r in rows if r["arm"] == arm and r["connections"]}
        assert sorted(conns) == ["kube-apiserver-1", "kube-apiserver-2", "kube-apiserver-3"], conns
        assert sum(conns.values()) >= 1, (arm, conns)
    with (out / "events.csv").open() as fh:
        events = [(r["arm"], r["event"]) for r in csv.DictReader(fh)]
    assert ("haproxy", "restart kube-apiserver-2") in events and ("haproxy", "LIST storm") in events
    text = (out / "report.md").read_text()
    assert "Memory per apiserver: the LIST storm after the restart" in text and "### Verdicts" in text


def test_admission_measures_both_arms_and_webhook_cpu_per_review(tmp_path: Path) -> None:
    out = tmp_path / "admission"
    text = check_report(run_scenario("admission", out))
    check_samples(out, ["webhooks-off", "webhooks-noop", "webhooks-on"])
    for arm in ("webhooks-off", "webhooks-noop", "webhooks-on"):
        stats = locust_stats(out, arm)
        assert int(stats["CREATE pod"]["Request Count"]) > 0 and int(stats["CREATE secret"]["Request Count"]) > 0
    # the apiservers' own timing of each call: gatekeeper's webhooks in the on arm, only the noop twins in the
    # noop arm, none with the webhooks off
    rows = re.findall(r"^\| (webhooks-[a-z]+)(?:-rate)? \| ([a-z.]+) \| [\d.]+ \| \d+ \|$", text, re.M)
    names = {arm: {name for a, name in rows if a == arm} for arm in ("webhooks-off", "webhooks-noop", "webhooks-on")}
    assert names["webhooks-on"] == {"secrets.gatekeeper.dev", "gpu.gatekeeper.dev"}, text
    assert names["webhooks-noop"] == {"secrets.noop.gatekeeper.dev", "gpu.noop.gatekeeper.dev"}, text
    assert not names["webhooks-off"], text
    m = re.search(r"\*\*([\d.]+) ms CPU per review\*\*", text)
    assert m and float(m.group(1)) > 0, text


def test_gogc_runs_both_arms_three_times_interleaved_and_judges_each_seed_claim(tmp_path: Path) -> None:
    out = tmp_path / "gogc"
    text = check_report(run_scenario("gogc", out))
    with (out / "runs.csv").open() as fh:
        runs = list(csv.DictReader(fh))
    assert [(r["arm"], r["run"]) for r in runs] == [(f"GOGC={g}", str(k)) for k in (1, 2, 3) for g in (100, 50)]
    check_samples(out, [f"GOGC={r['gogc']}-run{r['run']}" for r in runs])
    for r in runs:
        # at scale 0.02: 8 Secrets and 2 users; a replacement in flight moves the count by one per user
        assert int(r["secrets_before"]) == 8 and abs(int(r["secrets_after"]) - 8) <= 2, r
        assert float(r["rss_life1_mib"]) > 50 and float(r["rss_life2_mib"]) > 50, r
        assert float(r["heap_inuse_mib"]) > 10 and float(r["heap_released_mib"]) >= 0, r
        assert float(r["gc_per_min"]) >= 0, r  # a tiny run's window may hold no cycle (CI: 0.000 at load 5)
        assert float(r["secret_requests_per_s"]) > 0 and float(r["cpu_ms_per_request"]) > 0, r
        assert float(r["restart_s"]) > 0, r
        assert float(r["rss_growth_pct_per_min"]) == float(r["rss_growth_pct_per_min"]), r  # a slope, not NaN
    assert sum(float(r["gc_per_min"]) for r in runs) > 0, runs  # the apiservers' GC cycles are read at all
    for claim in ("A restart frees up to 40 %", "GOGC 50 lowers memory", "GOGC 50 stops growth over time"):
        assert re.search(rf"^\d\. \*{claim}[^*]*\* \*\*(reproduced|not reproduced|contradicted)\*\*: ", text,
                         re.M), claim
    per_arm = re.search(r"^\| GC cycles per minute[^|]*\| ([\d.]+) \([\d.]+ to [\d.]+\) \| ([\d.]+) \(", text, re.M)
    assert per_arm and float(per_arm.group(1)) >= 0 and float(per_arm.group(2)) >= 0, text


def test_dra_scale_interleaves_runs_on_one_ramp_and_compares_quiet_memory(tmp_path: Path) -> None:
    out = tmp_path / "dra-scale"
    text = check_report(run_scenario("dra-scale", out, scale=0.02))  # 20 pods at 5/s, 3 nodes, 2 runs per arm
    arms = ["device-plugin", "dra-webhook", "dra-kep5004"]
    labels = [f"{a}#{k}" for k in (1, 2) for a in arms]
    rows = check_samples(out, labels)
    with (out / "runs.csv").open() as fh:
        runs = list(csv.DictReader(fh))
    assert [f"{r['arm']}#{r['run']}" for r in runs] == labels  # A B C A B C, in the order they ran
    assert f"- run order: {' '.join(labels)}" in text
    with (out / "pods.csv").open() as fh:
        pods = list(csv.DictReader(fh))
    for r in runs:
        arm, label = r["arm"], f"{r['arm']}#{r['run']}"
        mine = [p for p in pods if p["arm"] == arm and p["run"] == r["run"]]
        assert len(mine) == 20 and len({p["pod"] for p in mine}) == 20, (label, len(mine))
        assert all(p["node"].startswith("gpu-node-") for p in mine), label
        assert all(float(p["latency_s"]) >= 0 and float(p["bound_s"]) >= float(p["created_s"]) for p in mine)
        assert all(float(p["condition_latency_s"]) >= 0 for p in mine), label
        # the same open-loop ramp in every run: 5 pods/s whatever the arm's latency
        assert 3.5 <= float(r["create_rate"]) <= 6.5, (label, r["create_rate"])
        assert float(r["claims"]) == (0 if arm == "device-plugin" else 20), (label, r["claims"])
        # quiet-window memory is a real sample, never above the peak; the heap after a forced GC was read
        assert 10 * MIB < float(r["sched_quiet"]) <= float(r["sched"]), label
        assert 10 * MIB < float(r["api_quiet"]) <= float(r["api"]), label
        assert float(r["sched_heap_quiet"]) <= float(r["sched_heap"]) and float(r["sched_heap_gc"]) > MIB, label
        assert float(r["heap_gc"]) > MIB, label
        sched = [float(x["rss_bytes"]) for x in rows
                 if x["arm"] == label and x["component"] == "kube-scheduler" and x["rss_bytes"]]
        assert sched and min(sched) > 10 * MIB, label
        create = locust_stats(out, f"{arm}-run{r['run']}")["CREATE gpu pod"]
        assert int(create["Request Count"]) == 20 and int(create["Failure Count"]) == 0, (label, create)
    results = dict(re.findall(r"^\| (device-plugin|dra-webhook|dra-kep5004) \| 2 \| 40/40 \| (\S+) ", text, re.M))
    assert results == {"device-plugin": "0", "dra-webhook": "20", "dra-kep5004": "20"}, results
    assert "### Ratios of the arms' medians" in text and "| dra-kep5004 / dra-webhook |" in text
    assert re.search(r"\| dra-webhook \| \d+ \[\d+-\d+\] \|", text), "memory cells are median [min-max]"
    assert "--kube-api-qps=500 --kube-api-burst=1000" in text
    assert "csi-translation-lib" in text  # why the topology-aware arm is missing, with the error
    peaks = re.findall(r"quiet RSS vs device plugin, medians \((\d+) vs (\d+) MiB\)", text)
    assert len(peaks) == 2 and all(int(a) > 0 and int(b) > 0 for a, b in peaks), peaks
