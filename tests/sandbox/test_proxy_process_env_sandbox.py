"""A benchmark's proxy gets its own environment (another tree on ``PYTHONPATH``, an allocator setting) from
``ProxyProcess.start(env=...)``, and the process that starts it keeps its own environment unchanged."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox


def test_the_env_given_to_start_reaches_the_proxy_and_not_the_caller(sandbox: SandboxState, tmp_path: Path) -> None:
    mark = f"GATEKEEPER_TEST_MARK_{uuid.uuid4().hex[:8].upper()}"
    proxy = ProxyProcess(sandbox, tmp_path, name="env-proxy")
    proxy.start(env={mark: "set"})
    try:
        assert proxy.proc is not None
        environ = Path(f"/proc/{proxy.proc.pid}/environ").read_bytes().split(b"\0")
        assert f"{mark}=set".encode() in environ
        assert b"PATH=" + os.environ["PATH"].encode() in environ  # added to the caller's environment, not instead
        assert mark not in os.environ
    finally:
        assert proxy.stop() == 0
