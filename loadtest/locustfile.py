"""Locust load: the request mix a GPU cluster's controllers put on the control plane.

Run it through ``loadtest/run_locust.py``, which starts Locust headless twice in one
run (straight at apiserver 1, then at the gatekeeper proxy of the same sandbox) and
prints the figures as ratios. Running it by hand works too:

    GK_SERVER=https://127.0.0.1:PORT GK_CERT_DIR=.sandbox/certs \\
        locust -f loadtest/locustfile.py --headless -u 20 -r 10 -t 30s

Why this mix: most control-plane requests are cheap GETs and small LISTs from
controllers and kubelets, plus some writes; the expensive part is periodic
cluster-wide LISTs (the seeds' secret LISTs). Watches are not generated here:
Locust measures request/response pairs, and watch behaviour is covered by the
proxy's GOAWAY tests.
"""

from __future__ import annotations

import os
import random
import ssl
import uuid

from locust import FastHttpUser, between, task

NAMESPACE = os.environ.get("GK_NAMESPACE", "gk-locust")
CERT_DIR = os.environ.get("GK_CERT_DIR", ".sandbox/certs")


def _sandbox_tls(cafile: str | None = None, **_: object) -> ssl.SSLContext:
    """Trust the sandbox CA (not the system bundle) and present the admin client certificate."""
    import gevent.ssl

    ctx = gevent.ssl.create_default_context(cafile=os.path.join(CERT_DIR, "ca.crt"))
    ctx.load_cert_chain(os.path.join(CERT_DIR, "admin.crt"), os.path.join(CERT_DIR, "admin.key"))
    return ctx


class ControllerLikeUser(FastHttpUser):
    """One controller's worth of traffic, authenticated with the sandbox admin client cert."""

    host = os.environ.get("GK_SERVER", "https://127.0.0.1:6443")
    wait_time = between(0.0, 0.05)
    network_timeout = 60.0
    connection_timeout = 10.0

    ssl_context_factory = _sandbox_tls

    def on_start(self) -> None:
        self.created: list[str] = []

    @task(10)
    def get_namespace(self) -> None:
        self.client.get(f"/api/v1/namespaces/{NAMESPACE}", name="GET namespace")

    @task(6)
    def list_configmaps(self) -> None:
        self.client.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps?limit=50", name="LIST configmaps (ns)")

    @task(3)
    def list_nodes(self) -> None:
        self.client.get("/api/v1/nodes", name="LIST nodes")

    @task(2)
    def create_configmap(self) -> None:
        name = f"locust-{uuid.uuid4().hex[:10]}"
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v" * 256}}
        with self.client.post(
            f"/api/v1/namespaces/{NAMESPACE}/configmaps", json=body, name="CREATE configmap", catch_response=True
        ) as resp:
            if resp.status_code == 201:
                self.created.append(name)
                resp.success()
            else:
                resp.failure(f"create returned {resp.status_code}: {resp.text[:200]}")

    @task(2)
    def delete_configmap(self) -> None:
        if not self.created:
            return
        name = self.created.pop(random.randrange(len(self.created)))
        self.client.delete(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{name}", name="DELETE configmap")

    @task(1)
    def list_secrets_cluster_wide(self) -> None:
        # The seeds' expensive call; through gatekeeper it is subject to the secrets-list policy.
        with self.client.get("/api/v1/secrets?limit=500", name="LIST secrets (cluster)", catch_response=True) as r:
            if r.status_code in (200, 429):
                r.success()
            else:
                r.failure(f"list secrets returned {r.status_code}")

    def on_stop(self) -> None:
        for name in self.created:
            self.client.delete(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{name}", name="DELETE configmap")
