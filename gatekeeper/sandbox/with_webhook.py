"""``sandbox up --with-webhook``: run ``gatekeeper webhook`` in front of the sandbox.

After the control plane is healthy this:

1. issues a serving certificate for 127.0.0.1 from the sandbox CA, and a
   client certificate for user ``gatekeeper-webhook`` bound by RBAC to exactly
   what template reconciliation needs (create ResourceClaimTemplates), so the
   sandbox proves the shipped RBAC is enough;
2. writes ``DIR/webhook/config.yaml`` (GPU ``defaultMode: dra``, ConfigMaps
   checked too) and starts the webhook in its own session, log in
   ``DIR/logs/webhook.log``, and waits for ``/readyz``;
   The webhook requires the apiservers' client certificate (``clientCaFile`` +
   ``allowedClientNames``, see gatekeeper.sandbox.webhook_client), so every
   review in the sandbox is authenticated as in a hardened install;
3. registers the Validating and Mutating webhook configurations with
   ``clientConfig.url`` + caBundle (see gatekeeper.webhook.registration);
4. waits until *every* apiserver enforces both (server-side dry-run of an
   oversized Secret is denied, of a GPU pod comes back rewritten), since each
   apiserver picks the configurations up on its own informer.

``state.extra["webhook"]`` records url, pid, config and log; ``sandbox down``
stops the process with the rest.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from gatekeeper.base.yamlfiles import load_yaml
from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import fleet, kubectl, mig, pki, processes, webhook_client
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.waiting import wait_until
from gatekeeper.webhook import registration

USER = "gatekeeper-webhook"
PROBE_NAMESPACE = "default"


def gpu_config(state: SandboxState) -> dict[str, Any]:
    """The webhook's gpu section for the sandbox's nodes: its device class, and for ``--mig-node`` /
    ``--mig-dra-nodes`` the MIG pools and model they were made with, so mig and mig-dra work out of the box."""
    out: dict[str, Any] = {"defaultMode": "dra", "deviceClass": state.extra.get("device_class", "gpu.nvidia.com")}
    models = list(dict.fromkeys(state.extra.get("mig_models") or []))
    if models:
        out["migPools"] = [{"name": m.lower(), "labelValue": mig.PRODUCTS[m], "gpuModel": m, "layout": mig.LAYOUT}
                           for m in models]
    if state.extra.get("mig_dra_nodes"):
        out["migGpuModel"] = mig.MIG_DRA_MODEL
    pools = state.extra.get("gpu_pools") or []
    if pools:  # the fleet's models, as an operator lists them: the known list, and what a percentage is of
        known = {p["model"]: {"name": p["model"], "productNames": [p["product"]], "memory": p["memory"]}
                 for p in pools}
        if state.extra.get("mig_dra_nodes"):
            dra = fleet.model(mig.MIG_DRA_MODEL)
            known.setdefault(dra.name, {"name": dra.name, "productNames": dra.product_names, "memory": dra.memory})
        out["gpuModels"] = list(known.values())
    return out


def webhook_config(state: SandboxState, serving: Any, kubeconfig: Path, port_file: Path) -> dict[str, Any]:
    return {"webhook": {
        "server": {"address": "127.0.0.1", "port": 0,
                   "certFile": str(serving.cert), "keyFile": str(serving.key),
                   "portFile": str(port_file), "certCheckIntervalSeconds": 1.0},
        "secrets": {"configMaps": True, "overrides": [
            {"types": ["helm.sh/release.v1"], "hardLimit": "1536Ki", "softLimit": "1Mi"}]},
        "gpu": gpu_config(state),
        "kubeconfig": str(kubeconfig),
    }}


def authenticated(config: dict[str, Any], client_ca: Path) -> dict[str, Any]:
    """Only the apiservers' webhook client certificate (sandbox/webhook_client.py) may call."""
    server = config["webhook"]["server"]
    server["clientCaFile"] = str(client_ca)
    server["allowedClientNames"] = [webhook_client.CLIENT_NAME]
    return config


def merge_user_config(config: dict[str, Any], user: Any, source: str) -> dict[str, Any]:
    """``--webhook-config FILE``: the file's ``webhook:`` section over the sandbox's defaults.

    ``server`` and ``kubeconfig`` stay the sandbox's (its certificates, port file and RBAC'd user),
    everything else (GPU modes, namespace defaults, secret limits) is the user's to set.
    """
    section = user.get("webhook") if isinstance(user, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"{source}: expected a mapping with a webhook: section")
    merged = dict(config["webhook"])
    for key, value in section.items():
        if key in ("server", "kubeconfig"):
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return {"webhook": merged}


def _probe_secret() -> str:
    data = base64.b64encode(b"\0" * (300 * 1024)).decode()
    return json.dumps({"apiVersion": "v1", "kind": "Secret",
                       "metadata": {"name": "gatekeeper-probe", "namespace": PROBE_NAMESPACE},
                       "data": {"blob": data}})


def _probe_pod() -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod",
                       # dra by annotation, so a --webhook-config with another defaultMode is still probed; 2 GPUs
                       # get alignment, so a KEP-5004 mapping (which serves 1 GPU alone) still gets rewritten
                       "metadata": {"name": "gatekeeper-probe", "namespace": PROBE_NAMESPACE,
                                    "annotations": {"gatekeeper.dev/gpu-mode": "dra"}},
                       "spec": {"containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.10",
                                                "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}})


def enforced(kubeconfig: str, binary: str | None) -> tuple[bool, str]:
    """Both webhooks answer on the apiserver behind ``kubeconfig`` (dry-run only, no side effects)."""
    p = kubectl.run(kubeconfig, "create", "--dry-run=server", "-f", "-", "-o", "name",
                    input=_probe_secret(), binary=binary)
    if registration.SECRETS_WEBHOOK not in p.stderr:
        return False, f"oversized secret not denied yet: {(p.stdout + p.stderr).strip()[:200]}"
    p = kubectl.run(kubeconfig, "create", "--dry-run=server", "-f", "-", "-o", "json",
                    input=_probe_pod(), binary=binary)
    if p.returncode != 0:
        return False, f"probe pod refused: {p.stderr.strip()[:200]}"
    if not json.loads(p.stdout).get("spec", {}).get("resourceClaims"):
        return False, "GPU pod not rewritten yet"
    return True, "enforced"


def start(state: SandboxState, args: argparse.Namespace) -> None:
    timeout = float(getattr(args, "timeout", 120.0) or 120.0)
    directory = Path(state.dir)
    binary = state.extra.get("kubectl")
    work = directory / "webhook"
    work.mkdir(parents=True, exist_ok=True)
    ca = PKI(state.certs_dir)
    serving = ca.issue_serving("webhook-serving", ips=["127.0.0.1"])
    ca.issue_client(USER, user=USER)
    sandbox_pki = pki.SandboxPKI(Path(state.certs_dir))
    # In the deployed topology (``--proxies N``) through the proxies, as the webhook's in-cluster config would be.
    server = state.extra.get("cluster_url") or state.apiserver_urls[0]
    kubeconfig = pki.write_kubeconfig(work / "kubeconfig", sandbox_pki, USER, server)
    kubectl.run(state.kubeconfig, "apply", "-f", "-", binary=binary, check=True,
                input=json.dumps({"apiVersion": "v1", "kind": "List",
                                  "items": registration.rbac({"kind": "User", "name": USER,
                                                              "apiGroup": "rbac.authorization.k8s.io"})}))
    # Pods are refused before any mutating webhook runs if their ServiceAccount is missing; without
    # the controller-manager nobody makes `default`, so the GPU-pod readiness probe needs it.
    kubectl.run(state.kubeconfig, "create", "serviceaccount", "default", "-n", PROBE_NAMESPACE, binary=binary)
    port_file = work / "port"
    port_file.unlink(missing_ok=True)
    config_path = work / "config.yaml"
    config = authenticated(webhook_config(state, serving, kubeconfig, port_file), Path(ca.cert_path("ca")))
    user_file = getattr(args, "webhook_config", None)
    if user_file:  # the user's policy sections; server (and so authentication) stays the sandbox's
        config = merge_user_config(config, load_yaml(user_file), str(user_file))
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = directory / "logs" / "webhook.log"
    argv = [sys.executable, "-m", "gatekeeper", "webhook", "--config", str(config_path)]
    rec = processes.start("webhook", argv, log, cwd=directory)
    state.processes.append(rec)
    state.save()

    def port_written() -> tuple[bool, str]:
        return (port_file.exists() and port_file.read_text().strip().isdigit()), "waiting for the port file"

    wait_until(rec, "webhook (listening)", port_written, timeout, interval=0.3)
    port = int(port_file.read_text())
    url = f"https://127.0.0.1:{port}"
    rec.ports = {"https": port}
    rec.urls = {"server": url, "validate": f"{url}/validate", "mutate": f"{url}/mutate",
                "metrics": f"{url}/metrics"}
    rec.health = f"{url}/readyz"
    state.save()
    tls = processes.TLSFiles(ca=Path(ca.cert_path("ca")))
    wait_until(rec, "webhook (/readyz)", lambda: processes.probe(rec.health, tls), timeout, interval=0.3)

    bundle = ca.ca_bundle()
    configs = [registration.validating_configuration({"url": url}, bundle),
               registration.mutating_configuration({"url": url}, bundle)]
    kubectl.run(state.kubeconfig, "apply", "-f", "-", binary=binary, check=True,
                input=json.dumps({"apiVersion": "v1", "kind": "List", "items": configs}))
    for kc in state.extra.get("apiserver_kubeconfigs") or [state.kubeconfig]:
        wait_until(rec, f"webhook (enforcement on {kc})", lambda kc=kc: enforced(kc, binary),  # type: ignore[misc]
                   timeout, interval=0.3)
    state.extra["webhook"] = {
        "url": url, "pid": rec.pid, "config": str(config_path), "log": str(log),
        "kubeconfig": str(kubeconfig),
        "validating": registration.VALIDATING_NAME, "mutating": registration.MUTATING_NAME,
    }
    state.save()
