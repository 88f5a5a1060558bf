"""Typed ``proxy:`` section of the gatekeeper config file, composed of the settings each folder owns.

The worker and process settings are here; camelCase YAML keys map onto these fields and unknown keys are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gatekeeper.base.config import ConfigError, from_mapping, register_section
from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.proxy.listen.settings import MAX_GOAWAY_CHANCE, ListenerSettings, ProtocolSettings
from gatekeeper.proxy.pipeline.settings import BackendSettings
from gatekeeper.proxy.upstream.settings import UpstreamSettings

__all__ = ["MAX_GOAWAY_CHANCE", "BackendSettings", "FlowControlSettings", "ListenerSettings", "ProtocolSettings",
           "ProxySettings", "UpstreamSettings", "load_section"]


@dataclass(frozen=True)
class ProxySettings:
    """Root of the ``proxy:`` section."""

    listener: ListenerSettings = field(default_factory=ListenerSettings)
    protocol: ProtocolSettings = field(default_factory=ProtocolSettings)
    backends: list[BackendSettings] = field(default_factory=list)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    flow_control: FlowControlSettings = field(default_factory=FlowControlSettings)
    workers: int = 0
    """Worker processes sharing the TLS port (0 = one per usable core, at most maxWorkers; 1 = no supervisor)."""
    max_workers: int = 8
    """Cap on the automatic worker count (an explicit ``workers``/``--workers`` may exceed it)."""
    worker_hang_seconds: float = 30.0
    """With several workers: a serving worker whose ``/healthz`` has not answered this long is killed and restarted,
    its seats released (0 = never)."""
    gc_young_threshold: int = 20000
    """Allocations between young-generation collections in a serving process (0 = Python's 700): each request
    allocates hundreds of short-lived objects, and collecting every 700 costs CPU for little memory."""
    gc_full_interval_seconds: float = 60.0
    """Seconds between the full garbage collections (then glibc's ``malloc_trim``) a serving process runs on a timer
    (0 = only Python's own, rare with ``gcYoungThreshold``): anything left in a reference cycle waits for one
    (``proxy/gcpace.py``, docs/proxy/memory.md)."""

    @property
    def tokens(self) -> TokenSettings:
        """Who token callers are (kept at ``flowControl.tokens``; used with flow control on or off)."""
        return self.flow_control.tokens

    def validate(self) -> None:
        if not self.backends:
            raise ValueError("backends: at least one apiserver URL is required")
        if self.workers < 0 or self.max_workers < 1:
            raise ValueError("workers must be >= 0 (0 = one per usable core) and maxWorkers >= 1")
        if not (self.worker_hang_seconds == 0 or self.worker_hang_seconds >= 1):
            raise ValueError(f"workerHangSeconds must be 0 (never) or at least 1, got {self.worker_hang_seconds}")
        if self.gc_young_threshold < 0:
            raise ValueError("gcYoungThreshold must be >= 0 (0 = Python's default)")
        if not (self.gc_full_interval_seconds == 0 or 1 <= self.gc_full_interval_seconds <= 3600):
            raise ValueError(f"gcFullIntervalSeconds must be 0 (off) or in [1, 3600], got "
                             f"{self.gc_full_interval_seconds}")


def load_section(data: Any, source: str, key: str) -> ProxySettings:
    """Parse ``proxy:`` (pure dataclasses), then read and check the flow-control policy files it names: here, so
    ``validate()`` stays free of I/O and a bad policy still stops the proxy at load."""
    settings = from_mapping(ProxySettings, data, source, key)
    if settings.flow_control.enabled:
        try:
            load_policy(settings.flow_control)
        except ValueError as exc:
            raise ConfigError(source, f"{key}.flowControl", str(exc)) from None
    return settings


register_section("proxy", load_section)
