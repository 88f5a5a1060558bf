"""Deploy tests need helm (and promtool) from `gatekeeper sandbox build`; CI builds them first."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatekeeper.sandbox.build import HELM, PROMTOOL, BuildError, deploy_tool


def _tool(component: object) -> Path:
    try:
        return deploy_tool(component)  # type: ignore[arg-type]
    except BuildError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    return _tool(HELM)


@pytest.fixture(scope="session")
def promtool_bin() -> Path:
    return _tool(PROMTOOL)
