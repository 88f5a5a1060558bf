"""h2spec (built by ``gatekeeper sandbox build``) against a real proxy in front of the sandbox: 145/145.

h2spec sends its requests without credentials, so the apiserver answers them
(401/403 ``Status`` bodies): a real backend, with response bodies long enough
that h2spec runs its flow-control cases instead of skipping them.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.build import h2spec_binary
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess
from gatekeeper.sandbox.with_proxy import default_flow_control

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def h2spec_proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """The proxy as deployed (default flow control)."""
    config = {"flowControl": default_flow_control()}
    proxy = ProxyProcess(sandbox, tmp_path_factory.mktemp("h2spec-proxy"), name="h2spec-proxy", user_config=config)
    try:
        proxy.start()
        yield proxy
    finally:
        rc = proxy.stop(timeout=60)
    assert rc == 0, f"proxy exit code {rc}: {processes.tail(proxy.log)}"


def test_h2spec_passes_every_case_against_the_proxy(h2spec_proxy: ProxyProcess) -> None:
    out = subprocess.run([str(h2spec_binary()), "-t", "-k", "-h", "127.0.0.1", "-p", str(h2spec_proxy.port),
                          "-o", "5"], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    summary = re.search(r"(\d+) tests, (\d+) passed, (\d+) skipped, (\d+) failed", text)
    assert summary, f"no h2spec summary (exit {out.returncode}):\n{text[-3000:]}"
    total, passed, skipped, failed = map(int, summary.groups())
    failures = text[text.find("Failures:"):][:4000] if failed else ""
    assert (total, passed, skipped, failed) == (145, 145, 0, 0), f"{summary.group(0)}\n{failures}"
