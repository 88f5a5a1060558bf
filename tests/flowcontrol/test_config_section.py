"""proxy.flowControl loads through the strict config loader; errors name the object and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

import gatekeeper.proxy.settings  # noqa: F401 - registers the proxy: section
from gatekeeper.base.config import ConfigError, load_config

SEEDS = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "flowcontrol-seeds.yaml"


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "gatekeeper.yaml"
    p.write_text(text)
    return p


BASE = """
proxy:
  backends: [{url: "https://127.0.0.1:6443"}]
  flowControl:
    serverConcurrencyLimit: 100
    queueWaitSeconds: 5
"""


def test_inline_objects_load(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            BASE
            + """
    priorityLevelConfigurations:
    - apiVersion: flowcontrol.apiserver.k8s.io/v1
      kind: PriorityLevelConfiguration
      metadata: {name: lists}
      spec: {type: Limited, limited: {nominalConcurrencyShares: 5, limitResponse: {type: Reject}}}
    flowSchemas:
    - apiVersion: flowcontrol.apiserver.k8s.io/v1
      kind: FlowSchema
      metadata: {name: lists}
      spec:
        priorityLevelConfiguration: {name: lists}
        rules: [{subjects: [{kind: Group, group: {name: "*"}}],
                 resourceRules: [{verbs: [list], apiGroups: ["*"], resources: ["*"], clusterScope: true}]}]
""",
        )
    )
    fc = cfg.proxy.flow_control
    assert fc.queue_wait_seconds == 5.0 and len(fc.flow_schemas) == 1


def test_bad_inline_object_names_file_object_and_field(tmp_path):
    path = write(
        tmp_path,
        BASE
        + """
    flowSchemas:
    - apiVersion: flowcontrol.apiserver.k8s.io/v1
      kind: FlowSchema
      metadata: {name: lists}
      spec:
        priorityLevelConfiguration: {name: nowhere}
        rules: []
""",
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: proxy.flowControl: flowSchemas[0]: FlowSchema/lists: ")
    assert "spec.priorityLevelConfiguration.name" in msg and "nowhere" in msg


def test_unknown_setting_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"proxy.flowControl.queueWait: unknown key"):
        load_config(write(tmp_path, BASE + "    queueWait: 15s\n"))


def test_seeds_example_enforces_two_concurrent_secret_lists(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            BASE.replace("serverConcurrencyLimit: 100", "serverConcurrencyLimit: 600") + f"    files: [{SEEDS}]\n",
        )
    )
    from gatekeeper.proxy.flowcontrol.edge.loading import load_policy

    policy = load_policy(cfg.proxy.flow_control)
    assert policy.limits["secrets-list"] == 2
    from gatekeeper.kube.requestinfo import parse
    from gatekeeper.proxy.messages import UserInfo

    fs, pl = policy.classify(UserInfo("bob", ["system:authenticated"]), parse("GET", "/api/v1/secrets?limit=500"))
    assert (fs.name, pl.name) == ("secrets-list", "secrets-list")
    fs, _ = policy.classify(UserInfo("bob", []), parse("GET", "/api/v1/namespaces/a/secrets"))
    assert fs.name == "secrets-list"
    fs, _ = policy.classify(UserInfo("bob", []), parse("GET", "/api/v1/namespaces/a/secrets/x"))
    assert fs.name != "secrets-list"
