"""What the webhook's sandbox tests share: the webhook the session sandbox runs (``sandbox up --with-webhook``)."""

from __future__ import annotations

from typing import Any

import pytest

from gatekeeper.sandbox.state import SandboxState


@pytest.fixture(scope="module")
def webhook(sandbox: SandboxState) -> dict[str, Any]:
    if "webhook" not in sandbox.extra:
        pytest.skip("the session sandbox runs without the webhook add-on (GATEKEEPER_SANDBOX_ADDONS)")
    return sandbox.extra["webhook"]
