"""A flow-control policy reload that fails keeps the running policy, says why, and is counted."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from gatekeeper.proxy.flowcontrol.core.policy import Policy
from gatekeeper.proxy.flowcontrol.edge.loading import Reloader, load_policy
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings


def level(name: str, shares: int) -> dict:
    return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
            "metadata": {"name": name},
            "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": shares,
                                                    "limitResponse": {"type": "Reject"}}}}


def reloads(result: str) -> float:
    return REGISTRY.get_sample_value("gatekeeper_flowcontrol_policy_reloads_total", {"result": result}) or 0.0


def failing() -> float:
    return REGISTRY.get_sample_value("gatekeeper_flowcontrol_policy_reload_failing") or 0.0


def level_noting(value: str) -> str:
    """A valid level whose ignored ``metadata.annotations.note`` is ``value`` (YAML lines, indented 6)."""
    return ("apiVersion: flowcontrol.apiserver.k8s.io/v1\nkind: PriorityLevelConfiguration\n"
            "metadata:\n  name: tenants\n  annotations:\n    note:\n" + value
            + "spec: {type: Limited, limited: {nominalConcurrencyShares: 10, limitResponse: {type: Reject}}}\n")


ALIAS_BOMB = "".join(["      - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"]
                     + [f"      - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 6)])
"""10**5 leaves under an ignored key: loaded and applied without the alias limit (nine levels: 10**9)."""


@pytest.mark.parametrize("breakage", [
    pytest.param(lambda p: p.write_text("kind: [\n"), id="not-yaml"),
    pytest.param(lambda p: p.write_text(level_noting(ALIAS_BOMB)), id="alias-bomb"),
    pytest.param(lambda p: p.write_text(level_noting("      &loop [*loop]\n")), id="alias-loop"),
    pytest.param(lambda p: p.write_text(yaml.safe_dump(level("x", 10)) + "# " + "x" * (1 << 20)), id="oversized"),
    pytest.param(lambda p: p.write_text("[" * 20000 + "]" * 20000), id="nested-too-deeply"),
    pytest.param(lambda p: p.write_bytes(b"\xff\xfe\x00kind"), id="not-utf8"),
    pytest.param(lambda p: p.write_text(yaml.safe_dump(level("x", -3))), id="invalid-value"),
    pytest.param(lambda p: p.unlink(), id="deleted"),
])
def test_a_failed_reload_keeps_the_policy_is_logged_and_counted_and_a_later_good_one_applies(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, breakage) -> None:
    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(level("tenants", 10)))
    settings = FlowControlSettings(files=[str(path)])
    applied: list[Policy] = []
    reloader = Reloader(settings, applied.append)
    failed0, applied0 = reloads("failed"), reloads("applied")

    breakage(path)
    with caplog.at_level(logging.ERROR):
        assert not reloader.reload()
    assert not applied, "a broken policy was applied"
    assert "keeping the running policy" in caplog.text and str(path) in caplog.text
    assert reloads("failed") == failed0 + 1 and failing() == 1

    path.write_text(yaml.safe_dump(level("tenants", 20)))
    assert reloader.reload()
    assert len(applied) == 1 and "tenants" in applied[0].levels
    assert reloads("applied") == applied0 + 1 and failing() == 0


def test_a_policy_file_that_is_not_utf8_is_named_at_start(tmp_path: Path) -> None:
    path = tmp_path / "flows.yaml"
    path.write_bytes(b"kind: \xff\n")
    with pytest.raises(ValueError, match=rf"{path}: not UTF-8 text \(byte 6\)"):
        load_policy(FlowControlSettings(files=[str(path)]))


class HeldParse:
    """``load_policy`` that, after reading the files, waits on the reload thread until released (the first
    ``hold`` parses); records the order of events."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: int = 1) -> None:
        from gatekeeper.proxy.flowcontrol.edge import loading

        self.events: list[str] = []
        self.parsed = threading.Event()
        self.release = threading.Event()
        real = loading.load_policy

        def held(settings: FlowControlSettings) -> Policy:
            n = len([e for e in self.events if e.startswith("parsed")]) + 1
            try:
                return real(settings)
            finally:
                self.events.append(f"parsed {n}")
                if n <= hold:
                    self.parsed.set()
                    assert self.release.wait(60), "the test never released the parse"

        monkeypatch.setattr(loading, "load_policy", held)


async def reload_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[Path, list[Policy], Reloader, HeldParse]:
    """A policy file, a reloader, and a reload requested whose parse has read the file and is held."""
    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(level("tenants", 10)))
    applied: list[Policy] = []
    reloader = Reloader(FlowControlSettings(files=[str(path)]), applied.append)
    held = HeldParse(monkeypatch)
    reloader.request()
    assert await asyncio.to_thread(held.parsed.wait, 60)
    return path, applied, reloader, held


async def test_a_reload_while_serving_parses_off_the_event_loop(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop keeps running while the files are parsed; only the swap happens on it."""
    _, applied, reloader, held = await reload_held(tmp_path, monkeypatch)
    held.events.append("loop ran")  # the loop is free while the parse is held on its thread
    held.release.set()
    await reloader.wait()
    assert held.events == ["parsed 1", "loop ran"] and len(applied) == 1


async def test_two_reloads_in_quick_succession_end_with_the_newest_file(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second SIGHUP arrives while the first parse (of the old file) runs: that parse must not finish last
    and win. Requests during a parse coalesce into one more parse, which reads the file as it is then."""
    path, applied, reloader, held = await reload_held(tmp_path, monkeypatch)  # the old file read, not applied
    path.write_text(yaml.safe_dump(level("newest", 20)))
    reloader.request()
    reloader.request()
    for _ in range(20):  # a request must not start a parse of its own meanwhile
        await asyncio.sleep(0.01)
    held.release.set()
    await reloader.wait()
    assert ["newest" in p.levels for p in applied] == [False, True], "an older parse finished last and won"
    assert held.events == ["parsed 1", "parsed 2"], "requests during a parse coalesce into one more parse"


async def test_a_failed_reload_while_serving_keeps_the_policy_is_logged_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "flows.yaml"
    path.write_text("kind: [\n")
    applied: list[Policy] = []
    reloader = Reloader(FlowControlSettings(files=[str(path)]), applied.append)
    failed0 = reloads("failed")
    with caplog.at_level(logging.ERROR):
        reloader.request()
        await reloader.wait()
    assert not applied and reloads("failed") == failed0 + 1 and failing() == 1
    assert "keeping the running policy" in caplog.text and str(path) in caplog.text


def test_a_worker_stopping_during_a_parse_exits_without_waiting_for_it(tmp_path: Path) -> None:
    """The parse thread must not hold the process at exit: a stopping worker would wait for a parse of a
    large file (seconds), or for ever on a policy path that became a FIFO. Here the parse never ends."""
    import subprocess
    import sys

    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(level("tenants", 10)))
    code = f"""
import asyncio, threading
from gatekeeper.proxy.flowcontrol.edge import loading
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
started = threading.Event()
def never_ends(settings):
    started.set()
    threading.Event().wait()
loading.load_policy = never_ends
async def main():
    reloader = loading.Reloader(FlowControlSettings(files=[{str(path)!r}]), print)
    reloader.request()
    await asyncio.to_thread(started.wait)
    reloader.cancel()
asyncio.run(main())
print("loop done", flush=True)
"""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: it waits for the parse thread")
    assert out.returncode == 0 and out.stdout == "loop done\n", out.stderr


def failures(reason: str) -> float:
    return REGISTRY.get_sample_value("gatekeeper_flowcontrol_policy_reload_failures_total", {"reason": reason}) or 0.0


def fifo(path: Path) -> list[int]:
    os.mkfifo(path)
    return []


def fifo_with_a_silent_writer(path: Path) -> list[int]:
    os.mkfifo(path)
    return [os.open(path, os.O_RDWR)]  # a writer that never writes: a plain read() waits for ever


def dev_zero_symlink(path: Path) -> list[int]:
    path.symlink_to("/dev/zero")
    return []


@pytest.mark.parametrize("make", [fifo, fifo_with_a_silent_writer, dev_zero_symlink])
async def test_a_policy_path_that_is_not_a_regular_file_is_refused_and_a_later_valid_file_applies(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, make) -> None:
    """Before, the reload thread blocked in open() (a FIFO without a writer) or read() (one whose writer never
    writes) for ever, and every later reload of the worker waited behind it: a fixed file was never applied."""
    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(level("tenants", 10)))
    applied: list[Policy] = []
    reloader = Reloader(FlowControlSettings(files=[str(path)]), applied.append)
    refused0 = failures("not_regular_file")
    path.unlink()
    fds = make(path)
    try:
        with caplog.at_level(logging.ERROR):
            reloader.request()
            await asyncio.wait_for(reloader.wait(), 10)
        assert not applied and failures("not_regular_file") == refused0 + 1 and failing() == 1
        assert str(path) in caplog.text and "not a regular file" in caplog.text, caplog.text
    finally:
        for fd in fds:
            os.close(fd)
    path.unlink()
    path.write_text(yaml.safe_dump(level("fixed", 20)))
    reloader.request()
    await asyncio.wait_for(reloader.wait(), 10)
    assert [("fixed" in p.levels) for p in applied] == [True] and failing() == 0


def test_a_policy_file_that_is_a_fifo_is_named_at_start(tmp_path: Path) -> None:
    path = tmp_path / "flows.yaml"
    os.mkfifo(path)
    with pytest.raises(ValueError, match=rf"{path}: flow-control policy file is a FIFO \(named pipe\), not a regular"):
        load_policy(FlowControlSettings(files=[str(path)]))


async def test_a_parse_stuck_past_the_reload_timeout_is_given_up_and_a_later_reload_applies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A parse that never ends (a regular file on a hung mount) no longer holds every later reload: it is given
    up at reloadTimeoutSeconds, the next reload runs on a fresh thread, and the stuck one's result, when it
    comes at last, is dropped (the newer policy stays)."""
    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(level("tenants", 10)))
    applied: list[Policy] = []
    reloader = Reloader(FlowControlSettings(files=[str(path)], reload_timeout_seconds=0.3), applied.append)
    held = HeldParse(monkeypatch)
    timeouts0 = failures("timeout")
    try:
        with caplog.at_level(logging.ERROR):
            reloader.request()
            await asyncio.wait_for(reloader.wait(), 10)
        assert not applied and failures("timeout") == timeouts0 + 1 and failing() == 1
        assert str(path) in caplog.text and "reloadTimeoutSeconds" in caplog.text, caplog.text
        path.write_text(yaml.safe_dump(level("newest", 20)))
        reloader.request()
        await asyncio.wait_for(reloader.wait(), 10)
        assert [("newest" in p.levels) for p in applied] == [True] and failing() == 0
    finally:
        held.release.set()  # the stuck parse ends: its older policy must not replace the newer one
    async with asyncio.timeout(10):  # the stuck parse ends
        while held.events.count("parsed 1") != 1 or reloader._stuck:  # noqa: ASYNC110 - set by the thread's end
            await asyncio.sleep(0.02)
    assert [("newest" in p.levels) for p in applied] == [True]


async def test_reloads_past_max_stuck_reloads_wait_for_a_stuck_one_to_end_then_apply(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread per SIGHUP behind a stuck file: with maxStuckReloads given-up parses running, a reload is
    refused (counted) and starts by itself once one of them ends."""
    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump(level("tenants", 10)))
    applied: list[Policy] = []
    reloader = Reloader(FlowControlSettings(files=[str(path)], reload_timeout_seconds=0.3, max_stuck_reloads=1),
                        applied.append)
    held = HeldParse(monkeypatch)
    stuck0 = failures("stuck")
    try:
        reloader.request()
        await asyncio.wait_for(reloader.wait(), 10)  # given up: one stuck thread
        path.write_text(yaml.safe_dump(level("newest", 20)))
        reloader.request()
        await asyncio.wait_for(reloader.wait(), 10)
        assert failures("stuck") == stuck0 + 1 and not applied
        reloader.request("file changed")  # the file poll asking again meanwhile: one wait, counted once
        await asyncio.wait_for(reloader.wait(), 10)
        assert failures("stuck") == stuck0 + 1 and not applied
    finally:
        held.release.set()
    async with asyncio.timeout(10):  # the refused reload starts once the stuck parse ended
        while not applied:  # noqa: ASYNC110 - set by a reload the stuck thread's end starts
            await asyncio.sleep(0.02)
    assert "newest" in applied[0].levels
