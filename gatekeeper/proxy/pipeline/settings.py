"""The pipeline's settings: the apiservers behind the proxy (``proxy.backends``), and what the pipeline reads of
the rest (``PipelineSettings``, met by ``gatekeeper.proxy.settings.ProxySettings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.proxy.upstream.settings import UpstreamSettings


@dataclass(frozen=True)
class BackendSettings:
    """One kube-apiserver behind the proxy."""

    url: str
    """https://host:port of the apiserver."""
    weight: int = 1
    """Relative share of requests (power-of-two-choices on in-flight / weight)."""
    name: str = ""
    """Label used in metrics (defaults to host:port)."""


class MetricsAccess(Protocol):
    @property
    def metrics_groups(self) -> list[str]: ...


class DeadlineAccess(Protocol):
    @property
    def request_timeout_seconds(self) -> float: ...


class PipelineSettings(Protocol):
    """What ``stages.build`` reads: backends, upstream settings, ``/metrics`` readers, the requests' deadline."""

    @property
    def backends(self) -> list[BackendSettings]: ...

    @property
    def upstream(self) -> UpstreamSettings: ...

    @property
    def listener(self) -> MetricsAccess: ...

    @property
    def protocol(self) -> DeadlineAccess: ...

    @property
    def tokens(self) -> TokenSettings: ...
