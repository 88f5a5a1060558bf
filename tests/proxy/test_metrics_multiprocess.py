"""The proxy's /metrics page is the one multiprocess-aware renderer (gatekeeper.runtime.metrics.render)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


def python(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_proxy_page_sums_the_samples_of_other_worker_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):  # two "workers" that each retried once, then exited
        python("from gatekeeper.proxy import metrics; metrics.UPSTREAM_RETRIES.inc()", env)
    page = python("from gatekeeper.proxy import metrics; print(metrics.render()[0].decode())", env)
    line = next(x for x in page.splitlines() if x.startswith("gatekeeper_proxy_upstream_retries_total"))
    assert float(line.split()[-1]) == 2.0


WORKER = """
import os, sys
from gatekeeper.proxy import metrics
for _ in range(int(sys.argv[1])):
    metrics.UPSTREAM_RETRIES.inc()
    metrics.REQUEST_DURATION.labels("get").observe(0.3)
print(os.getpid())
"""


def page_of(path: Path) -> dict[str, float]:
    """The merged page of the files in ``path``, read in this process (a renderer process would add its own)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gatekeeper.runtime.metrics import WrittenFilesCollector

    registry = CollectorRegistry()
    registry.register(WrittenFilesCollector(str(path)))
    out = generate_latest(registry).decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in out.splitlines()
            if line.startswith(("gatekeeper_proxy_upstream_retries_total", "gatekeeper_proxy_request_duration"))}


def test_a_dead_workers_counts_stay_on_the_page_in_a_bounded_number_of_files(tmp_path: Path) -> None:
    """What the supervisor does for each reaped worker: its counter and histogram files are folded into
    one archive per type, so a crash-looping worker no longer adds two files per restart."""
    from gatekeeper.runtime.metrics import absorb_dead_process

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    pids = []
    for n in (1, 2, 3, 4):  # four short-lived "workers", each counting n retries and n observations
        out = subprocess.run([sys.executable, "-c", WORKER, str(n)], capture_output=True, text=True, timeout=60,
                             env=env, check=True)
        pids.append(int(out.stdout))
    before = page_of(tmp_path)
    assert before["gatekeeper_proxy_upstream_retries_total"] == 10.0
    for pid in pids:
        absorb_dead_process(pid, str(tmp_path))
        assert page_of(tmp_path) == pytest.approx(before)  # never a count lost or doubled, at every step
    names = sorted(p.name for p in tmp_path.glob("*.db"))
    assert names == ["counter_archive.db", "histogram_archive.db"], names


def test_an_inherited_metrics_dir_must_be_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gatekeeper.base.errors import UsageError
    from gatekeeper.runtime.multiproc import enable_multiprocess

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)  # the tests run as root: another local user pre-created it
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(theirs))
    with pytest.raises(UsageError, match="owned by uid 4242"):
        enable_multiprocess()

    link = tmp_path / "link"
    link.symlink_to(tmp_path / "somewhere")
    (tmp_path / "somewhere").mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(link))
    with pytest.raises(UsageError, match="symbolic link"):
        enable_multiprocess()


def test_an_inherited_metrics_dir_others_could_write_is_closed_and_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An emptyDir is 0777: ours, but anyone in the pod could have planted files; close it, then sweep."""
    from gatekeeper.runtime.multiproc import enable_multiprocess

    shared = tmp_path / "emptydir"
    shared.mkdir()
    shared.chmod(0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (shared / "counter_999999.db").symlink_to(victim)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(shared))
    assert enable_multiprocess() == str(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    assert not list(shared.glob("*.db")) and victim.read_text() == "precious"


def test_a_command_removes_the_metrics_dir_it_made_but_keeps_an_inherited_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gatekeeper.runtime.multiproc import multiprocess_mode

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")  # unset for the mode, and restored after the test
    with multiprocess_mode("gatekeeper-test-metrics-") as made:
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == made and os.path.isdir(made)
    assert not os.path.exists(made)

    inherited = tmp_path / "inherited"
    inherited.mkdir(mode=0o700)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(inherited))
    with multiprocess_mode() as path:
        assert path == str(inherited)
    assert inherited.is_dir()
