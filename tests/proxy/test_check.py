"""`gatekeeper proxy --config FILE --check` on the config `sandbox up --with-proxy` writes, and broken variants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess
from gatekeeper.sandbox.with_proxy import default_flow_control

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def sbx(request: pytest.FixtureRequest) -> SandboxState:
    if os.environ.get("GATEKEEPER_SANDBOX_DIR"):
        return SandboxState.load(os.environ["GATEKEEPER_SANDBOX_DIR"])
    value = request.getfixturevalue("sandbox")
    return value if isinstance(value, SandboxState) else SandboxState.load(getattr(value, "dir", value))


@pytest.fixture
def config(sbx: SandboxState, tmp_path: Path) -> dict:  # type: ignore[type-arg]
    """The proxy config the sandbox deploys (seeds' policy), as data; nothing is started."""
    proxy = ProxyProcess(sbx, tmp_path, user_config={"flowControl": default_flow_control() or {}})
    return yaml.safe_load(proxy.config_path.read_text())  # type: ignore[no-any-return]


def run_check(tmp_path: Path, config: dict) -> subprocess.CompletedProcess[str]:  # type: ignore[type-arg]
    path = tmp_path / "checked.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "gatekeeper", "proxy", "--config", str(path), "--check"],
                          capture_output=True, text=True, timeout=60)


def test_check_accepts_the_deployed_config_and_lists_the_seeds_levels(
        sbx: SandboxState, config: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    out = run_check(tmp_path, config)
    assert out.returncode == 0, out.stderr
    assert "  secrets-list: 2 seats" in out.stdout.splitlines()
    assert "  exempt: exempt" in out.stdout.splitlines()
    for url in sbx.apiserver_urls:
        assert url in out.stdout


def test_check_reports_a_serving_key_that_is_not_the_certificates(config: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    """Both files exist, so only loading them finds it; the proxy would crash-loop on it at start."""
    config["proxy"]["listener"]["keyFile"] = config["proxy"]["upstream"]["clientKeyFile"]
    out = run_check(tmp_path, config)
    assert out.returncode == 2
    assert "error: proxy.listener (serving certificate, key, client CA):" in out.stderr


def test_check_reports_a_ca_file_that_is_not_a_certificate(config: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    bogus = tmp_path / "not-a-ca.pem"
    bogus.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    config["proxy"]["upstream"]["caFile"] = str(bogus)
    out = run_check(tmp_path, config)
    assert out.returncode == 2
    assert "error: proxy.upstream (CA, front-proxy client certificate):" in out.stderr


def test_check_reports_a_missing_file_by_its_key(config: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    config["proxy"]["listener"]["certFile"] = str(tmp_path / "gone.crt")
    out = run_check(tmp_path, config)
    assert out.returncode == 2
    assert "proxy.listener.certFile" in out.stderr and "gone.crt" in out.stderr


def test_check_names_the_policy_object_that_is_invalid(config: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "apiVersion: flowcontrol.apiserver.k8s.io/v1\nkind: PriorityLevelConfiguration\n"
        "metadata: {name: broken}\nspec: {type: Limited, limited: {nominalConcurrencyShares: -3}}\n")
    config["proxy"]["flowControl"]["files"] = [str(policy)]
    out = run_check(tmp_path, config)
    assert out.returncode == 2
    assert "policy.yaml" in out.stderr and "broken" in out.stderr
