"""What a running sandbox is made of, persisted as ``DIR/sandbox.json``.

``sandbox up`` writes it, ``status``/``down`` and the test fixtures read it, and
the add-ons (webhook, proxy) append their processes to it. Keeping it one
plain JSON document means an operator can read it with ``jq`` too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatekeeper.base.errors import UsageError

STATE_FILE = "sandbox.json"


class StateError(UsageError):
    """``sandbox.json`` exists but cannot be read back (corrupt or from an incompatible version)."""


@dataclass
class ProcessRecord:
    """One process the sandbox started and must stop."""

    name: str
    """Unique component name, e.g. ``etcd``, ``kube-apiserver-1``, ``webhook``, ``proxy``."""
    pid: int
    """Process id; ``down`` signals its whole process group."""
    cmd: list[str]
    """The exact argv, for debugging and for restarting a component in tests."""
    log: str
    """Path of the file that holds its stdout and stderr."""
    ports: dict[str, int] = field(default_factory=dict)
    """Named listening ports, e.g. ``{"secure": 40123}``."""
    urls: dict[str, str] = field(default_factory=dict)
    """Named URLs, e.g. ``{"server": "https://127.0.0.1:40123", "metrics": ...}``."""
    health: str = ""
    """URL whose 200 means healthy (empty: alive pid is enough)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment the process was started with (e.g. GOGC)."""
    cgroup: str = ""
    """The memory cgroup it runs in (``--apiserver-memory-limit``); a restart goes back into it."""


@dataclass
class SandboxState:
    """Everything ``down`` needs to stop the sandbox and tests need to use it."""

    dir: str
    processes: list[ProcessRecord] = field(default_factory=list)
    certs_dir: str = ""
    """PKI directory (gatekeeper.certs.pki.PKI layout: ca.crt, front-proxy-ca.crt, admin.crt, ...)."""
    kubeconfig: str = ""
    """Admin kubeconfig for apiserver 1."""
    apiserver_urls: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Add-on data (e.g. ``{"webhook": {"url": ...}, "proxy": {"url": ..., "metricsUrl": ...}}``)."""

    @property
    def path(self) -> Path:
        return Path(self.dir) / STATE_FILE

    def process(self, name: str) -> ProcessRecord:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"sandbox in {self.dir} has no process named {name!r}")

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)

    @classmethod
    def load(cls, directory: Path | str) -> SandboxState:
        path = Path(directory) / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"no sandbox in {directory} ({path} does not exist); run `gatekeeper sandbox up`"
            )
        try:
            raw = json.loads(path.read_text())
            procs = [ProcessRecord(**p) for p in raw.pop("processes", [])]
            return cls(processes=procs, **raw)
        except (ValueError, TypeError, AttributeError) as exc:  # not JSON, or not our shape
            raise StateError(
                f"{path} is not a readable sandbox state ({type(exc).__name__}: {exc}); the processes it "
                "listed cannot be found from it: stop them by pid, then remove the file"
            ) from None
