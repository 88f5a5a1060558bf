"""The flow-control section the sandbox proxy runs with by default: the seeds' policy.

``seeds.yaml`` ships as package data so an installed gatekeeper has it; it is kept byte-identical to
``deploy/examples/flowcontrol-seeds.yaml`` by a test, and named by absolute path so SIGHUP re-reads it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

SEEDS_POLICY = Path(str(resources.files(__package__ or __name__.rpartition(".")[0]) / "seeds.yaml"))


def sandbox_flow_control() -> dict[str, Any]:
    """``proxy.flowControl`` for the sandbox: the seeds' "2 concurrent secret LISTs" policy."""
    return {"files": [str(SEEDS_POLICY)]}
