"""Typed ``proxy.flowControl`` section (owned by gatekeeper.proxy.flowcontrol)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlowControlSettings:
    """API Priority and Fairness in the proxy."""

    enabled: bool = False
    """Placeholder until the flow-control issue lands."""
