"""Build steps for the deploy tooling (helm, promtool, CRDs) and the apiservers' webhook client identity."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from gatekeeper.sandbox import components as comp
from gatekeeper.sandbox import webhook_client
from gatekeeper.sandbox.build import COMPONENTS, ETCD, HELM, PROMTOOL, go_build_argv, module_version


def test_promtool_is_built_without_service_discovery_and_tags_change_the_stamp() -> None:
    argv = go_build_argv(PROMTOOL, Path("/out"))
    assert argv[argv.index("-tags") + 1] == "remove_all_sd"
    assert PROMTOOL.stamp() != replace(PROMTOOL, tags=()).stamp()
    assert "-tags" not in go_build_argv(ETCD, Path("/out"))  # existing components' stamps are unchanged


def test_deploy_tools_are_pinned_in_their_gomods_and_built_by_sandbox_build() -> None:
    assert {HELM, PROMTOOL} <= set(COMPONENTS)
    for c in (HELM, PROMTOOL):
        gomod = (c.source_dir() / "go.mod").read_text()
        assert module_version(gomod, c.module) == c.version()
        assert c.packages[0].split("/cmd/")[0] in (c.source_dir() / "tools.go").read_text()
    assert "version.version=" + HELM.version() in HELM.ldflags()


def test_apiservers_present_a_client_certificate_to_webhooks(tmp_path: Path) -> None:
    from gatekeeper.certs.pki import PKI, load_cert

    PKI(tmp_path / "pki").init()
    config = webhook_client.write(tmp_path / "pki", tmp_path)
    doc = yaml.safe_load(config.read_text())
    assert {p["name"] for p in doc["plugins"]} == {"ValidatingAdmissionWebhook", "MutatingAdmissionWebhook"}
    kubeconfig = yaml.safe_load(Path(doc["plugins"][0]["configuration"]["kubeConfigFile"]).read_text())
    (user,) = kubeconfig["users"]
    assert user["name"] == "*"
    cert = load_cert(Path(user["user"]["client-certificate"]))
    assert cert.subject.rfc4514_string() == f"CN={webhook_client.CLIENT_NAME}"
    layout = comp.Layout(tmp_path)
    argv = comp.apiserver_argv(Path("kube-apiserver"), layout, index=1, port=1, etcd_url="http://x",
                               node_lifecycle=True, admission_config=config)
    assert f"--admission-control-config-file={config}" in argv
