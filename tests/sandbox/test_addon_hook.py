"""How `sandbox up` calls the add-ons (`gatekeeper.sandbox.lifecycle.ADDONS`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gatekeeper.base.errors import UsageError
from gatekeeper.sandbox import lifecycle
from gatekeeper.sandbox.state import ProcessRecord, SandboxState


def quiet(_: str) -> None:
    pass


def test_an_unknown_add_on_is_a_clear_error_naming_the_known_ones(tmp_path: Path) -> None:
    state = SandboxState(dir=str(tmp_path))
    expected = r"--with-nothere: unknown add-on; expected one of: proxy, webhook"
    with pytest.raises(UsageError, match=expected):
        lifecycle._start_addons(state, argparse.Namespace(), ("nothere",), quiet)


def test_add_on_processes_are_saved_even_when_the_add_on_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def start(state: SandboxState, args: argparse.Namespace) -> None:
        assert args.proxy_goaway_chance == 0.5, "add-ons see the up command's arguments"
        state.processes.append(ProcessRecord(name="fake", pid=1, cmd=["fake"], log=""))
        raise RuntimeError("backend never became ready")

    monkeypatch.setitem(lifecycle.ADDONS, "fake", start)
    state = SandboxState(dir=str(tmp_path))
    with pytest.raises(lifecycle.ComponentFailed) as info:
        lifecycle._start_addons(state, argparse.Namespace(proxy_goaway_chance=0.5), ("fake",), quiet)
    assert info.value.name == "fake"
    assert "RuntimeError: backend never became ready" in info.value.detail
    assert [p.name for p in SandboxState.load(tmp_path).processes] == ["fake"]


def test_an_add_on_that_waited_with_wait_until_keeps_its_own_step_in_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def start(state: SandboxState, args: argparse.Namespace) -> None:
        lifecycle.wait_until(None, "fake (/readyz)", lambda: (False, "503 not ready"), timeout=0, interval=0.01)

    monkeypatch.setitem(lifecycle.ADDONS, "fake", start)
    with pytest.raises(lifecycle.ComponentFailed) as info:
        lifecycle._start_addons(SandboxState(dir=str(tmp_path)), argparse.Namespace(), ("fake",), quiet)
    assert info.value.name == "fake (/readyz)"
    assert info.value.detail == "not healthy after 0s: 503 not ready"
