"""Fixtures of the sandbox lifecycle tests: a sandbox of the test's own, beside the shared one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gatekeeper.sandbox.testing import run_down


@pytest.fixture
def own_sandbox_dir(tmp_path: Path) -> Iterator[Path]:
    """A state directory for a sandbox the test brings up itself; whatever it started is taken down after."""
    directory = tmp_path / "own-sandbox"
    yield directory
    run_down(directory)
