"""The apiservers' client identity towards admission webhooks (``--admission-control-config-file``).

kube-apiserver authenticates to a webhook only if its AdmissionConfiguration gives the
Validating/MutatingAdmissionWebhook plugins a kubeconfig; a user entry named ``*`` applies to every
webhook host. Every sandbox apiserver gets one (harmless without webhooks), written before they start
because the plugins read it once at startup. ``--with-webhook`` then sets the webhook's
``clientCaFile`` to the sandbox CA and ``allowedClientNames`` to :data:`CLIENT_NAME`, so the sandbox
tests run with the same authentication a production install would configure.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gatekeeper.certs.pki import PKI

CLIENT_NAME = "kube-apiserver-webhook-client"
"""CN of the client certificate the apiservers present to webhooks."""


def admission_configuration(kubeconfig: Path) -> dict[str, object]:
    plugin_config = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration",
                     "kubeConfigFile": str(kubeconfig)}
    return {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [{"name": name, "configuration": plugin_config}
                    for name in ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")],
    }


def write(certs_dir: Path, directory: Path) -> Path:
    """Issue the client certificate and write kubeconfig + AdmissionConfiguration; returns the latter."""
    pki = PKI(certs_dir)
    pki.issue_client(CLIENT_NAME, user=CLIENT_NAME)
    kubeconfig = directory / "admission-webhooks.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "users": [{"name": "*", "user": {"client-certificate": str(pki.cert_path(CLIENT_NAME)),
                                         "client-key": str(pki.key_path(CLIENT_NAME))}}],
    }, sort_keys=False))
    kubeconfig.chmod(0o600)
    config = directory / "admission-config.yaml"
    config.write_text(yaml.safe_dump(admission_configuration(kubeconfig), sort_keys=False))
    return config
