"""`gatekeeper sandbox up --with-proxy` runs the proxy with the seeds' policy unless --proxy-config says otherwise."""

from __future__ import annotations

from pathlib import Path

import gatekeeper
from gatekeeper.base.config import from_mapping
from gatekeeper.proxy.flowcontrol.edge.defaults import SEEDS_POLICY, sandbox_flow_control
from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl, from_settings
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.sandbox.with_proxy import default_flow_control


def test_sandbox_default_section_is_the_seeds_policy():
    section = default_flow_control()
    assert section == sandbox_flow_control() == {"files": [str(SEEDS_POLICY)]}
    settings = from_mapping(FlowControlSettings, section, "sandbox", "proxy.flowControl")
    policy = load_policy(settings)
    assert policy.limits["secrets-list"] == 2
    assert isinstance(from_settings(settings), FlowControl)


def test_disabled_flow_control_yields_no_middleware():
    assert from_settings(FlowControlSettings(enabled=False)) is None


def test_the_packaged_seeds_policy_is_inside_the_package_and_equals_the_deploy_example():
    package = Path(gatekeeper.__file__).resolve().parent
    assert SEEDS_POLICY.resolve().is_relative_to(package), "the sandbox default must not need the source tree"
    example = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "flowcontrol-seeds.yaml"
    assert SEEDS_POLICY.read_bytes() == example.read_bytes(), (
        f"{SEEDS_POLICY} and {example} differ: edit one, copy it over the other"
    )
