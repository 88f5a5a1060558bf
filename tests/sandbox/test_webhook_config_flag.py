"""``sandbox up --webhook-config FILE``: the user's webhook section over the add-on's defaults."""

from __future__ import annotations

import pytest

from gatekeeper.sandbox.with_webhook import merge_user_config

BASE = {"webhook": {"server": {"port": 0, "certFile": "/sandbox/tls.crt"}, "kubeconfig": "/sandbox/kc",
                    "gpu": {"defaultMode": "dra", "deviceClass": "gpu.nvidia.com"},
                    "secrets": {"configMaps": True}}}


def test_user_gpu_settings_override_and_keep_the_sandbox_device_class() -> None:
    user = {"webhook": {"gpu": {"defaultMode": "shared", "sharedDefaultMemory": "16Gi"}}}
    out = merge_user_config(BASE, user, "f.yaml")["webhook"]
    assert out["gpu"] == {"defaultMode": "shared", "deviceClass": "gpu.nvidia.com", "sharedDefaultMemory": "16Gi"}
    assert out["secrets"] == {"configMaps": True}


def test_server_and_kubeconfig_stay_the_sandboxs() -> None:
    user = {"webhook": {"server": {"port": 9}, "kubeconfig": "/elsewhere"}}
    out = merge_user_config(BASE, user, "f.yaml")["webhook"]
    assert out["server"] == BASE["webhook"]["server"] and out["kubeconfig"] == "/sandbox/kc"


@pytest.mark.parametrize("bad", [None, [], {"proxy": {}}, {"webhook": "x"}])
def test_a_file_without_a_webhook_section_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"f\.yaml: expected a mapping with a webhook: section"):
        merge_user_config(BASE, bad, "f.yaml")


def test_sandbox_mig_nodes_become_the_webhooks_mig_pools() -> None:
    from types import SimpleNamespace

    from gatekeeper.base.config import from_mapping
    from gatekeeper.sandbox.with_webhook import gpu_config
    from gatekeeper.webhook.settings import GpuSettings

    state = SimpleNamespace(extra={"device_class": "gpu.nvidia.com", "mig_models": ["A100-40GB", "H100-80GB"],
                                   "mig_dra_nodes": ["mig-dra-0"]})
    s = from_mapping(GpuSettings, gpu_config(state), "sandbox", "webhook.gpu")  # type: ignore[arg-type]
    assert [(p.label_value, p.allowed()) for p in s.mig_pools] == [
        ("NVIDIA-A100-SXM4-40GB", ("1g.5gb", "2g.10gb", "3g.20gb")),
        ("NVIDIA-H100-80GB-HBM3", ("1g.10gb", "2g.20gb", "3g.40gb"))]
    assert s.mig_gpu_model == "H100-80GB"  # the sandbox's dynamic-MIG GPUs, for mig-dra
    assert "migPools" not in gpu_config(SimpleNamespace(extra={}))  # type: ignore[arg-type]
