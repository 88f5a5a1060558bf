"""Instructions per small GET in the whole proxy process, under callgrind: pure against compiled, no wall clock.

Not a test. The test suite's in-process bench (``tests/proxy/edge_kit.py``: the real TLS listener and pipeline in
front of an echoing HTTP/1.1 backend) runs in one process under ``valgrind --tool=callgrind``; the backend and an
httpx HTTP/2 client (client certificate: no flow control, the HTTP/1.1 upstream) run in others. After ``--warm``
GETs the counters are zeroed, then each of ``--windows`` windows of ``--n`` sequential GETs on one connection is
dumped and reported as instructions per request. ``--tree`` is the source tree to import (``PYTHONPATH``): a copy
compiled in place with mypyc, or a pure one::

    python loadtest/bench_proxy_ir.py --tree /tmp/pure [--n 300] [--windows 2]
    python loadtest/bench_proxy_ir.py --tree /tmp/compiled

The tree must hold ``gatekeeper/`` and ``tests/proxy/edge_kit.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _kit() -> Any:
    sys.path.insert(0, os.path.join(os.environ["BENCH_TREE"], "tests", "proxy"))
    import edge_kit

    return edge_kit


async def _backend(d: Path) -> None:
    kit = _kit()
    backend = kit.EchoBackend(kit.PKI(d))
    (d / "url").write_text(await backend.start())
    await asyncio.sleep(24 * 3600)


async def _proxy(d: Path, url: str) -> None:
    from gatekeeper.proxy.listen.server import ProxyServer
    from gatekeeper.proxy.pipeline.stages import build
    from gatekeeper.runtime import compiled

    kit = _kit()
    settings = kit.proxy_settings(kit.PKI(d), [url])
    server = ProxyServer(settings, build(settings).handler, close_delay=0.05)
    await server.start()
    (d / "compiled").write_text(compiled.summary())
    (d / "port").write_text(str(server.port))
    await asyncio.sleep(24 * 3600)


def _client(d: Path, port: int, n: int) -> None:
    import httpx

    pki = _kit().PKI(d)
    with httpx.Client(http2=True, verify=str(pki.cert_path("ca")),
                      cert=(str(pki.cert_path("admin")), str(pki.key_path("admin")))) as client:
        for i in range(n):
            r = client.get(f"https://localhost:{port}/api/v1/namespaces/default/pods/web-{i % 16}",
                           headers={"accept": "application/json", "user-agent": "kubectl/v1.37.2 (linux/amd64)"})
            if r.status_code != 200 or r.http_version != "HTTP/2":
                raise SystemExit(f"GET failed: {r.status_code} {r.http_version}")


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> str:
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited {proc.returncode}")
        time.sleep(0.2)
    return path.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", required=True, help="source tree to import (gatekeeper/ and tests/proxy/)")
    parser.add_argument("--n", type=int, default=300, help="GETs per window")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--warm", type=int, default=300, help="GETs before the counters are zeroed")
    parser.add_argument("--role", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role, d = args.role[0], Path(args.role[1])
        if role == "pki":
            _kit().make_pki(d)
        elif role == "backend":
            asyncio.run(_backend(d))
        elif role == "proxy":
            asyncio.run(_proxy(d, args.role[2]))
        else:
            _client(d, int(args.role[2]), int(args.role[3]))
        return

    tree = str(Path(args.tree).resolve())
    env = {**os.environ, "BENCH_TREE": tree, "PYTHONPATH": tree}
    me = [sys.executable, str(Path(__file__).resolve()), "--tree", tree, "--role"]
    d = Path(tempfile.mkdtemp(prefix="bench-proxy-ir-"))
    subprocess.run([*me, "pki", str(d)], env=env, check=True)
    backend = subprocess.Popen([*me, "backend", str(d)], env=env)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        url = _wait_for(d / "url", backend)
        proxy = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/cg.out",
                                  *me, "proxy", str(d), url], env=env, stderr=subprocess.DEVNULL)
        port = _wait_for(d / "port", proxy)
        subprocess.run([*me, "client", str(d), port, str(args.warm)], env=env, check=True)
        quiet: dict[str, Any] = {"check": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        subprocess.run(["callgrind_control", "-z", str(proxy.pid)], **quiet)
        per_request = []
        for window in range(1, args.windows + 1):
            subprocess.run([*me, "client", str(d), port, str(args.n)], env=env, check=True)
            subprocess.run(["callgrind_control", "-d", str(proxy.pid)], **quiet)
            dump = Path(f"{d}/cg.out.{window}")
            while not dump.exists():
                time.sleep(0.2)
            time.sleep(0.5)
            total = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.MULTILINE)
            if total is None:
                raise SystemExit(f"no total in {dump}")
            per_request.append(int(total.group(1)) // args.n)
        print(f"compiled modules {(d / 'compiled').read_text()}: instructions per GET by window "
              + " ".join(f"{x:,}" for x in per_request))
    finally:
        for p in (proxy, backend):
            if p is not None:
                p.terminate()
                p.wait()


if __name__ == "__main__":
    main()
