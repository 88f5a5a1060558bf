"""Real client-go informers as a load: the seeds' storm the way today's controllers send it.

``gatekeeper sandbox build`` builds ``informers`` from ``gatekeeper/sandbox/gomod/informers`` (client-go v0.37, the
sandbox's release): one Secrets informer per tenant identity, each with its own client, exiting once all have synced.
With client-go's defaults each sends a watch-list; ``watch_list=False`` sets ``KUBE_FEATURE_WatchListClient=false``,
and they LIST as the seeds' clients did.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gatekeeper.sandbox.build import informers_binary


@dataclass(frozen=True)
class InformerResult:
    """One informer's line of output."""

    name: str
    synced: bool
    seconds: float
    objects: int
    responses: dict[str, int]
    """``"<kind> <status>"`` -> count, kind being watch-list, watch or list (``"list 200"``, ``"watch-list 429"``)."""
    error: str = ""

    def count(self, kind: str, status: str = "") -> int:
        return sum(n for k, n in self.responses.items() if k.split()[0] == kind and (not status or
                                                                                    k.split()[1] == status))


def identities_file(identities: Sequence[dict[str, str]], work: Path) -> Path:
    """The JSON the program reads, from ``cluster.tenants()`` identities (tokens go to files of their own)."""
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for i, ident in enumerate(identities):
        name = ident["user"].rpartition(":")[2]
        if ident["kind"] == "cert":
            out.append({"name": name, "cert": ident["cert"], "key": ident["key"]})
        else:
            token = work / f"token-{i}"
            token.write_text(ident["token"])
            token.chmod(0o600)
            out.append({"name": name, "tokenFile": str(token)})
    path = work / "identities.json"
    path.write_text(json.dumps(out))
    return path


def run(server: str, ca: str | Path, namespace: str, identities: Sequence[dict[str, str]], work: Path, *,
        watch_list: bool = True, timeout: float = 600) -> list[InformerResult]:
    """Start one informer per identity against ``server`` and wait until all synced (or ``timeout``)."""
    env = dict(os.environ)
    env["KUBE_FEATURE_WatchListClient"] = "true" if watch_list else "false"
    argv = [str(informers_binary()), "--server", server, "--ca", str(ca), "--namespace", namespace,
            "--identities", str(identities_file(identities, work)), "--timeout", f"{int(timeout)}s"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 60, env=env)
    results = []
    for line in proc.stdout.splitlines():
        d = json.loads(line)
        results.append(InformerResult(name=d["name"], synced=d["synced"], seconds=d["seconds"],
                                      objects=d["objects"], responses=d.get("responses") or {},
                                      error=d.get("error", "")))
    if len(results) != len(identities):
        raise RuntimeError(f"informers exited {proc.returncode} with {len(results)} of {len(identities)} results: "
                           f"{proc.stderr[-2000:]}")
    return results


def run_spread(servers: Sequence[str], ca: str | Path, namespace: str, identities: Sequence[dict[str, str]],
               work: Path, *, watch_list: bool = True, timeout: float = 600) -> list[InformerResult]:
    """As :func:`run`, the identities dealt round-robin over ``servers`` (direct to each apiserver), one process each,
    all started together."""
    shares = [(server, list(identities[i::len(servers)])) for i, server in enumerate(servers)]
    shares = [(server, ids) for server, ids in shares if ids]
    with ThreadPoolExecutor(len(shares)) as pool:
        done = [pool.submit(run, server, ca, namespace, ids, work / f"server-{i}", watch_list=watch_list,
                            timeout=timeout) for i, (server, ids) in enumerate(shares)]
        return [r for f in done for r in f.result()]
