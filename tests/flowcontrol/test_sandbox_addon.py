"""The proxy that `gatekeeper sandbox up --with-proxy` starts enforces the seeds' policy out of the box."""

from __future__ import annotations

import ssl
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import storm_kit as kit

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox


def _client(state: SandboxState, cert: Path, key: Path) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))
    ctx.load_cert_chain(str(cert), str(key))
    return httpx.Client(base_url=state.extra["proxy"]["url"], verify=ctx, timeout=60)


def test_sandbox_proxy_classifies_secret_lists_with_the_seeds_policy(sandbox: SandboxState) -> None:
    if "proxy" not in sandbox.extra:
        pytest.fail("the session sandbox runs without the proxy add-on (GATEKEEPER_SANDBOX_ADDONS?)", pytrace=False)
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
    assert applied.returncode == 0, applied.stderr
    try:
        issued = PKI(sandbox.certs_dir).issue_client("fc-addon-probe", user="addon-probe", groups=[kit.STORM_GROUP])
        with _client(sandbox, issued.cert, issued.key) as c:
            for _ in range(50):  # the apiservers' RBAC informers pick the new binding up within moments
                r = c.get("/api/v1/namespaces/default/secrets")
                if r.status_code != 403:
                    break
                time.sleep(0.2)
            assert r.status_code == 200, r.text
            assert r.headers["x-gatekeeper-pf-flowschema"] == "secrets-list"
            assert r.headers["x-gatekeeper-pf-prioritylevel"] == "secrets-list"
            r = c.get("/api/v1/namespaces/default/configmaps")  # the other kind of big objects, same level
            assert r.status_code == 200 and r.headers["x-gatekeeper-pf-flowschema"] == "secrets-list"
            r = c.get("/api/v1/namespaces/default/pods")
            assert r.status_code == 200 and r.headers["x-gatekeeper-pf-flowschema"] == "workload"
        certs = SandboxPKI(Path(sandbox.certs_dir))
        with _client(sandbox, certs.crt("admin"), certs.key("admin")) as c:
            r = c.get("/api/v1/namespaces/default/secrets")
            assert r.status_code == 200 and r.headers["x-gatekeeper-pf-flowschema"] == "exempt"
        with urllib.request.urlopen(sandbox.extra["proxy"]["metricsUrl"], timeout=10) as m:
            text = m.read().decode()
        assert kit.metric_sum(text, "gatekeeper_flowcontrol_nominal_limit_seats", priority_level="secrets-list") == 2
        assert kit.metric_sum(text, "gatekeeper_flowcontrol_dispatched_requests_total", flow_schema="secrets-list") >= 1
    finally:
        kit.kubectl(sandbox, "delete", "-f", "-", "--ignore-not-found", input=kit.storm_rbac_and_observer())


def test_proxy_process_reloads_policy_on_sighup_and_keeps_it_on_a_bad_edit(
    sandbox: SandboxState, tmp_path: Path
) -> None:
    import signal

    policy = tmp_path / "flows.yaml"
    policy.write_text(kit.SEEDS.read_text())
    with kit.run_proxy(sandbox, tmp_path, {"files": [str(policy)], "reloadIntervalSeconds": 0}) as proxy:

        def limit() -> float:
            return kit.metric_sum(
                proxy.metrics(), "gatekeeper_flowcontrol_nominal_limit_seats", priority_level="secrets-list"
            )

        def wait_for(expected: float) -> float:
            for _ in range(50):
                if (got := limit()) == expected:
                    return got
                time.sleep(0.1)
            return limit()

        assert limit() == 2
        # 3 shares of 1 + 294 + 5 (+2) -> ceil(600 * 3 / 302) = 6 seats
        policy.write_text(
            kit.SEEDS.read_text().replace("nominalConcurrencyShares: 1\n", "nominalConcurrencyShares: 3\n")
        )
        proxy.proc.send_signal(signal.SIGHUP)
        assert wait_for(6) == 6
        policy.write_text(kit.SEEDS.read_text().replace("handSize: 4", "handSize: 40"))
        proxy.proc.send_signal(signal.SIGHUP)
        for _ in range(50):
            if "keeping the running policy" in proxy.log.read_text():
                break
            time.sleep(0.1)
        log = proxy.log.read_text()
        assert "keeping the running policy" in log and "PriorityLevelConfiguration/secrets-list" in log
        assert "handSize" in log
        assert limit() == 6
