"""The flow-control section the sandbox proxy runs with by default: the seeds' policy.

``gatekeeper sandbox up --with-proxy`` (``gatekeeper.sandbox.with_proxy``)
puts this section in the proxy's generated config unless ``--proxy-config``
is given. The objects live in one place, ``deploy/examples/flowcontrol-seeds.yaml``,
referenced by absolute path so ``kill -HUP`` on the proxy re-reads an edited copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEEDS_POLICY = Path(__file__).resolve().parents[3] / "deploy" / "examples" / "flowcontrol-seeds.yaml"


def sandbox_flow_control() -> dict[str, Any] | None:
    """``proxy.flowControl`` for the sandbox: the seeds' "2 concurrent secret LISTs" policy, or None
    (flow control's built-in defaults) when the checkout's deploy/ directory is not available."""
    if not SEEDS_POLICY.is_file():
        return None
    return {"files": [str(SEEDS_POLICY)]}
