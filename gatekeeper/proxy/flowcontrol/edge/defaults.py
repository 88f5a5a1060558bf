"""The flow-control section the sandbox proxy runs with by default: the seeds' policy.

``gatekeeper sandbox up --with-proxy`` (``gatekeeper.sandbox.with_proxy``)
puts this section in the proxy's generated config unless ``--proxy-config``
is given. The objects ship inside the package (``seeds.yaml`` beside this
module, package data), so an installed gatekeeper has them without the source
tree; ``deploy/examples/flowcontrol-seeds.yaml`` is the operator-facing copy,
kept byte-identical by tests/flowcontrol/test_sandbox_default.py. The section
names the file by absolute path so ``kill -HUP`` on the proxy re-reads it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

SEEDS_POLICY = Path(str(resources.files(__package__ or __name__.rpartition(".")[0]) / "seeds.yaml"))


def sandbox_flow_control() -> dict[str, Any]:
    """``proxy.flowControl`` for the sandbox: the seeds' "2 concurrent secret LISTs" policy."""
    return {"files": [str(SEEDS_POLICY)]}
