"""Command lines and manifests the sandbox hands to real processes, checked without starting them."""

from __future__ import annotations

from pathlib import Path

from gatekeeper.sandbox import components as comp
from gatekeeper.sandbox import gpu


def flags(argv: list[str]) -> dict[str, str]:
    out = {}
    for a in argv[1:]:
        key, _, value = a.partition("=")
        assert key not in out, f"flag {key} given twice"
        out[key] = value
    return out


def apiserver(index: int, node_lifecycle: bool = True) -> dict[str, str]:
    layout = comp.Layout(Path("/sbx"))
    return flags(comp.apiserver_argv(Path("/bin/kube-apiserver"), layout, index=index, port=6443 + index,
                                     etcd_url="http://127.0.0.1:2379", node_lifecycle=node_lifecycle))


def test_apiservers_share_etcd_ca_and_service_account_keys_but_not_ports_or_cert_dirs() -> None:
    a, b = apiserver(1), apiserver(2)
    for shared in ("--etcd-servers", "--client-ca-file", "--service-account-issuer",
                   "--service-account-key-file", "--service-account-signing-key-file", "--tls-cert-file",
                   "--requestheader-client-ca-file"):
        assert a[shared] == b[shared], shared
    assert a["--secure-port"] != b["--secure-port"]
    assert a["--cert-dir"] != b["--cert-dir"]
    assert a["--bind-address"] == "127.0.0.1"
    assert a["--endpoint-reconciler-type"] == "none"


def test_only_the_front_proxy_ca_and_name_may_assert_identities_by_header() -> None:
    a = apiserver(1)
    assert a["--requestheader-client-ca-file"] == "/sbx/certs/front-proxy-ca.crt"
    assert a["--client-ca-file"] == "/sbx/certs/ca.crt"
    assert a["--requestheader-allowed-names"] == "front-proxy-client"
    assert a["--requestheader-username-headers"] == "X-Remote-User"
    assert a["--requestheader-group-headers"] == "X-Remote-Group"
    assert a["--requestheader-extra-headers-prefix"] == "X-Remote-Extra-"


def test_webhooks_rbac_and_dra_are_on() -> None:
    a = apiserver(1)
    plugins = a["--enable-admission-plugins"].split(",")
    assert "MutatingAdmissionWebhook" in plugins and "ValidatingAdmissionWebhook" in plugins
    assert a["--authorization-mode"] == "Node,RBAC"
    assert "resource.k8s.io/v1=true" in a["--runtime-config"].split(",")


def test_node_taint_admission_is_disabled_exactly_when_no_node_lifecycle_controller_runs() -> None:
    assert "--disable-admission-plugins" not in apiserver(1, node_lifecycle=True)
    off = apiserver(1, node_lifecycle=False)
    assert off["--disable-admission-plugins"] == "TaintNodesByCondition"
    assert "TaintNodesByCondition" not in off["--enable-admission-plugins"]


def test_controller_manager_runs_default_controllers_with_the_apiservers_signing_key() -> None:
    layout = comp.Layout(Path("/sbx"))
    kcm = flags(comp.controller_manager_argv(Path("/bin/kcm"), layout, 10257))
    assert kcm["--controllers"] == "*"
    assert kcm["--service-account-private-key-file"] == apiserver(1)["--service-account-signing-key-file"]
    assert kcm["--kubeconfig"] == "/sbx/kube-controller-manager.kubeconfig"
    assert kcm["--bind-address"] == "127.0.0.1" and kcm["--secure-port"] == "10257"


def test_kwok_manages_only_annotated_nodes_with_lease_heartbeats() -> None:
    layout = comp.Layout(Path("/sbx"))
    k = flags(comp.kwok_argv(Path("/bin/kwok"), layout, Path("/cache/stages.yaml"), 10247))
    assert k["--manage-nodes-with-annotation-selector"] == "kwok.x-k8s.io/node=fake"
    assert int(k["--node-lease-duration-seconds"]) > 0
    assert k["--config"].split(",") == ["/cache/stages.yaml", "/sbx/kwok-exec.yaml"]
    assert k["--server-address"] == "127.0.0.1:10247"


def test_kwok_plays_the_kubelet_the_apiserver_dials_for_exec() -> None:
    layout = comp.Layout(Path("/sbx"))
    k = flags(comp.kwok_argv(Path("/bin/kwok"), layout, Path("/cache/stages.yaml"), 10247))
    assert (k["--node-ip"], k["--node-port"]) == ("127.0.0.1", "10247")
    assert k["--tls-cert-file"] and k["--tls-private-key-file"]
    a = apiserver(1)
    assert a["--kubelet-preferred-address-types"] == "InternalIP"
    assert a["--kubelet-certificate-authority"] == a["--client-ca-file"]
    spec = comp.kwok_exec_config()["spec"]
    assert spec == {"selector": {"matchNamespaces": [comp.EXEC_NAMESPACE]}, "execs": [{"local": {}}]}


def test_gpu_node_advertises_capacity_and_is_selected_by_kwok() -> None:
    node = gpu.node("gpu-node-0", 8)
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert node["status"]["allocatable"] == node["status"]["capacity"]


def test_resource_slice_has_one_device_per_gpu_split_over_two_pcie_roots() -> None:
    rs = gpu.resource_slice("gpu-node-1", 8, node_uid="uid-1")
    spec = rs["spec"]
    assert spec["driver"] == "gpu.nvidia.com" and spec["nodeName"] == "gpu-node-1"
    assert spec["pool"] == {"name": "gpu-node-1", "generation": 1, "resourceSliceCount": 1}
    devices = spec["devices"]
    assert [d["name"] for d in devices] == [f"gpu-{i}" for i in range(8)]
    roots = [d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"] for d in devices]
    assert roots[:4] == [roots[0]] * 4 and roots[4:] == [roots[4]] * 4 and roots[0] != roots[4]
    uuids = {d["attributes"]["uuid"]["string"] for d in devices}
    assert len(uuids) == 8
    assert uuids.isdisjoint(d["attributes"]["uuid"]["string"]
                            for d in gpu.resource_slice("gpu-node-0", 8)["spec"]["devices"])
    assert all(d["capacity"]["memory"]["value"] == "80Gi" for d in devices)
    assert rs["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_device_class_selects_the_drivers_whole_gpus_by_cel() -> None:
    dc = gpu.device_class()
    assert dc["apiVersion"] == "resource.k8s.io/v1"
    assert dc["spec"]["selectors"] == [{"cel": {"expression":
        'device.driver == "gpu.nvidia.com" && device.attributes["gpu.nvidia.com"].type == "gpu"'}}]


def test_node_readiness_waits_for_the_not_ready_taint_to_go_when_node_lifecycle_runs() -> None:
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    tainted = {**ready, "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}}
    assert gpu.node_ready(ready, require_untainted=True)
    assert not gpu.node_ready(tainted, require_untainted=True)
    assert gpu.node_ready(tainted, require_untainted=False)
    assert not gpu.node_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                              require_untainted=False)


def test_extra_apiserver_flags_come_last_so_storage_read_lists_can_be_configured() -> None:
    layout = comp.Layout(Path("/sbx"))
    argv = comp.apiserver_argv(Path("/bin/kube-apiserver"), layout, index=1, port=6444,
                               etcd_url="http://127.0.0.1:2379", node_lifecycle=True,
                               extra=("--watch-cache-sizes=secrets#0", "--goaway-chance=0.001"))
    assert argv[-2:] == ["--watch-cache-sizes=secrets#0", "--goaway-chance=0.001"]
    assert flags(argv)["--watch-cache-sizes"] == "secrets#0"


def test_extended_resource_mapping_sets_the_device_class_field_and_drops_node_capacity() -> None:
    from gatekeeper.sandbox import gpu as sgpu

    assert "extendedResourceName" not in sgpu.device_class()["spec"]
    assert sgpu.device_class(True)["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "nvidia.com/gpu" in sgpu.node("n", 8)["status"]["allocatable"]
    assert "nvidia.com/gpu" not in sgpu.node("n", 8, False)["status"]["allocatable"]
