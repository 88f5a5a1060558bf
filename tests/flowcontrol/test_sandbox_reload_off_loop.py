"""A flow-control policy reload does not stop the proxy's workers from answering: the real ``gatekeeper proxy
--workers 2`` in front of the sandbox.

The files of a reload used to be read and validated on each worker's serving loop: about 2.4 s per MiB of
YAML (pure-Python parser), during which the worker answered nothing. Here every proxy process loads
``held_parse/sitecustomize.py``, which blocks the parse of the new file until the test creates a release
file: a worker that parses on its loop cannot answer the requests sent meanwhile, and the test fails on its
client timeout (no timing assertion). The order of events is the proof: both workers are inside the parse,
requests are answered, then the parse is released and the new policy applied.
"""

from __future__ import annotations

import os
import signal
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess
from gatekeeper.sandbox.with_proxy import default_flow_control

pytestmark = pytest.mark.sandbox

HELD = Path(__file__).parent / "held_parse"
WORKERS = 2
REQUEST_TIMEOUT = 20.0
"""How long a request may wait before the test calls the worker blocked (the parse is held for good)."""


def level(name: str) -> str:
    return yaml.safe_dump({"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
                           "metadata": {"name": name},
                           "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 5,
                                                                   "limitResponse": {"type": "Reject"}}}})


def hold_mark() -> str:
    """The marker ``held_parse/sitecustomize.py`` looks for (loaded by path: it is not this process's
    sitecustomize)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("held_parse_sitecustomize", HELD / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.HOLD_MARK)


class Held:
    def __init__(self, proxy: ProxyProcess, hold: Path, policy: Path) -> None:
        self.proxy, self.hold, self.policy = proxy, hold, policy


@pytest.fixture(scope="module")
def held(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    work = tmp_path_factory.mktemp("reload-off-loop")
    hold, policy = work / "hold", work / "policy.yaml"
    hold.mkdir()
    policy.write_text(level("before-reload"))
    fc = default_flow_control()
    fc["files"] = [str(policy)]
    fc["reloadIntervalSeconds"] = 0  # SIGHUP only: the test decides when the reload happens
    proxy = ProxyProcess(sandbox, work, name="reload-off-loop", workers=WORKERS, user_config={"flowControl": fc})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(HELD), *filter(None, [os.environ.get("PYTHONPATH")])]))
        env.setenv("GATEKEEPER_TEST_HOLD_DIR", str(hold))
        try:
            proxy.start()
            yield Held(proxy, hold, policy)
        finally:
            (hold / "release").touch()
            rc = proxy.stop(timeout=60)
    assert rc == 0, f"proxy exit code {rc}: {processes.tail(proxy.log)}"


def get_version(proxy: ProxyProcess) -> int:
    """``GET /version`` through the proxy on a new connection (any worker may take it)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=proxy.tls(cert=True)))
    with opener.open(f"{proxy.url}/version", timeout=REQUEST_TIMEOUT) as resp:
        return int(resp.status)


def wait_for(predicate, what: str, proxy: ProxyProcess, limit: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: {processes.tail(proxy.log)}"
        time.sleep(0.1)


def test_requests_are_answered_while_every_worker_parses_a_reloaded_policy(held: Held) -> None:
    proxy = held.proxy
    assert proxy.proc is not None
    applied = proxy.metric("gatekeeper_flowcontrol_policy_reloads_total", result="applied")
    held.policy.write_text(level("after-reload") + hold_mark() + "\n")
    os.kill(proxy.proc.pid, signal.SIGHUP)  # the supervisor forwards it to every worker
    wait_for(lambda: len(list(held.hold.glob("parsing-*"))) == WORKERS, "not every worker began the reload", proxy)

    events = ["every worker parsing"]
    for _ in range(2 * WORKERS):  # new connections: the workers take turns or not, each is held all the same
        try:
            status = get_version(proxy)
        except (OSError, ssl.SSLError) as exc:
            pytest.fail(f"a request waited for the policy parse ({exc!r}): the worker parses on its serving loop")
        assert status == 200
        events.append("request answered")
    assert not (held.hold / "release").exists() and len(list(held.hold.glob("parsing-*"))) == WORKERS
    (held.hold / "release").touch()
    events.append("parse released")
    assert events == ["every worker parsing", *["request answered"] * (2 * WORKERS), "parse released"]

    wait_for(lambda: proxy.metric("gatekeeper_flowcontrol_policy_reloads_total", result="applied")
             >= applied + WORKERS, "the reloaded policy was not applied by every worker", proxy)
    assert 'gatekeeper_flowcontrol_nominal_limit_seats{priority_level="after-reload"}' in proxy.metrics()
    assert get_version(proxy) == 200
