"""Session fixtures for tests that need the real local control plane (``@pytest.mark.sandbox``).

One sandbox serves the whole session, because starting it costs seconds to
minutes: 3 kube-apiservers on one etcd, scheduler + controller manager, 2 KWOK
GPU nodes, plus the webhook and proxy add-ons once their modules exist
(``GATEKEEPER_SANDBOX_ADDONS=webhook,proxy`` or ``none`` overrides the
detection). It is brought up through the real CLI in a subprocess and always
torn down with ``sandbox down``, also when ``up`` fails or the run is
interrupted; an ``atexit`` hook is the last line of defence.

Missing binaries FAIL the tests rather than skip them: CI builds them first,
and a silently skipped integration suite proves nothing.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatekeeper.runtime import compiled
from gatekeeper.sandbox import lifecycle
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import (
    UP_TIMEOUT,
    Kubectl,
    SandboxUpFailed,
    kubectl_binary,
    processes_mentioning,
    run_down,
    sandbox_up,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the loadtest package lives beside gatekeeper/ (not installed); its harness is shared
    sys.path.insert(0, str(REPO))

ADDONS = tuple(lifecycle.ADDONS)


def selected_addons() -> list[str]:
    """Every add-on `sandbox up` knows (lifecycle.ADDONS), unless ``GATEKEEPER_SANDBOX_ADDONS`` says otherwise."""
    env = os.environ.get("GATEKEEPER_SANDBOX_ADDONS")
    if env is not None:
        names = [] if env.strip() in ("", "none") else [n.strip() for n in env.split(",") if n.strip()]
        unknown = set(names) - set(ADDONS)
        if unknown:
            raise pytest.UsageError(f"GATEKEEPER_SANDBOX_ADDONS: unknown add-on(s) {sorted(unknown)}")
        return names
    return list(ADDONS)


def require_binaries() -> None:
    from gatekeeper.sandbox.build import BuildError, installed

    try:
        installed()
    except BuildError as exc:
        pytest.fail(f"{exc}. The sandbox tests need them; CI runs `gatekeeper sandbox build` first.",
                    pytrace=False)


def up_or_fail(state_dir: Path, *extra: str) -> SandboxState:
    """``sandbox up`` for a test: missing binaries or a failed up FAIL the test (never skip)."""
    require_binaries()
    try:
        return sandbox_up(state_dir, *extra)
    except SandboxUpFailed as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def own_sandbox() -> Any:
    """:func:`up_or_fail` for module fixtures that need a sandbox of their own (other flags)."""
    return up_or_fail


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxState]:
    """The shared sandbox: 3 apiservers, 2 GPU nodes x 8 GPUs, scheduler + KCM, detected add-ons."""
    state_dir = tmp_path_factory.mktemp("sandbox")
    addons = selected_addons()
    torn_down = False

    def teardown() -> None:
        nonlocal torn_down
        if not torn_down:
            torn_down = True
            run_down(state_dir)

    atexit.register(teardown)
    # A CI timeout sends SIGTERM, whose default action skips both `finally` and atexit; turn it into
    # an interrupt so the sandbox (in its own sessions, immune to the signal) is still torn down.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main else None
    try:
        extra = ["--apiservers", "3", "--gpu-nodes", "2", "--with-scheduler",
                 *(f"--with-{a}" for a in addons)]
        state = up_or_fail(state_dir, *extra)
        state.extra.setdefault("test_addons", addons)
        yield state
    finally:
        teardown()
        atexit.unregister(teardown)
        if in_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)
    # "No process survives the test session": anything still naming the state dir was missed by down.
    leftover = processes_mentioning(state_dir)
    if leftover:
        pytest.fail(f"sandbox down left processes running: {leftover}", pytrace=False)


@pytest.fixture(scope="session")
def sandbox_state(sandbox: SandboxState) -> SandboxState:
    """Alias of ``sandbox`` for tests that read it as data."""
    return sandbox


@pytest.fixture(scope="session")
def admin_kubeconfig(sandbox: SandboxState) -> Path:
    """Admin (system:masters) kubeconfig for apiserver 1."""
    return Path(sandbox.kubeconfig)


@pytest.fixture(scope="session")
def kubectl(sandbox: SandboxState) -> Kubectl:
    """``kubectl(*args, kubeconfig=admin, input=None, timeout=60, check=False) -> CompletedProcess``."""
    from gatekeeper.sandbox import kubectl as kc

    binary = kubectl_binary(sandbox)

    def run(*args: str, kubeconfig: Path | str | None = None, input: str | None = None,
            timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess[str]:
        return kc.run(kubeconfig or sandbox.kubeconfig, *args, binary=binary, input=input, timeout=timeout,
                      check=check)

    return run


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    """A fresh namespace per test, ready for pods (deleted afterwards without waiting)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    kubectl("create", "namespace", name, check=True)
    # Pods are refused until the serviceaccount controller has made `default` here.
    deadline = time.monotonic() + 60
    while kubectl("get", "serviceaccount", "default", "-n", name).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(f"namespace {name}: no default ServiceAccount after 60s", pytrace=False)
        time.sleep(0.2)
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    """Sandbox tests share one control plane; give them the session's time budget, not a unit test's."""
    for item in items:
        if item.get_closest_marker("sandbox") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(UP_TIMEOUT + 300))


def pytest_report_header() -> str:
    return f"gatekeeper compiled modules (mypyc): {compiled.summary()}"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test old code: after ``pip install -e .`` the compiled extensions sit beside the sources and win
    the import, so an edited hot module would be tested as it was when it was built."""
    stale = compiled.stale_modules()
    if stale:
        pytest.exit(f"compiled extensions older than their source: {', '.join(stale)}. Rebuild them "
                    "(pip install -e .), or test pure Python (GATEKEEPER_PURE=1 pip install -e . removes them)",
                    returncode=4)
