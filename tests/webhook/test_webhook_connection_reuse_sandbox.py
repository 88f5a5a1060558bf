"""The real kube-apiservers reuse their connections to the webhook: creates do not each pay a TLS handshake.

Counted on the webhook (``gatekeeper_webhook_connections_total`` against ``gatekeeper_webhook_reviews_total``),
not timed. Measured before this test existed: 0 new connections over 80 Secret creates through one apiserver
(and ``strace -c`` saw no accept), so the latency a review adds to a create is not handshakes.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox

CREATES = 30


def _counters(url: str, ca: Path) -> tuple[float, float]:
    """(connections accepted, Secret reviews answered) as the webhook counts them."""
    with urllib.request.urlopen(url + "/metrics", context=ssl.create_default_context(cafile=str(ca)),
                                timeout=10) as r:
        text = r.read().decode()
    connections = reviews = 0.0
    for line in text.splitlines():
        if line.startswith("gatekeeper_webhook_connections_total "):
            connections = float(line.split()[-1])
        elif line.startswith("gatekeeper_webhook_reviews_total{") and 'policy="secret-size"' in line:
            reviews += float(line.split()[-1])
    return connections, reviews


def test_secret_creates_reuse_the_apiservers_connections_to_the_webhook(webhook, sandbox, kubectl,
                                                                         namespace) -> None:
    ca = Path(sandbox.certs_dir) / "ca.crt"
    items = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"reuse-{i}", "namespace": namespace},
              "stringData": {"a": "x" * 1024}} for i in range(CREATES)]
    kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
            check=True)  # warms every apiserver it reaches; the counted run below starts from open connections
    connections0, reviews0 = _counters(webhook["url"], ca)
    for item in items:
        item["metadata"]["name"] += "-b"
    kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
            check=True)
    connections1, reviews1 = _counters(webhook["url"], ca)
    assert reviews1 - reviews0 >= CREATES
    # kubectl talks to one apiserver (the admin kubeconfig's): its pool is warm, so nothing new is expected; one
    # connection of slack for a reconnect, against the 30 a webhook that closed connections would see.
    assert connections1 - connections0 <= 1, (
        f"{connections1 - connections0:.0f} new connections for {reviews1 - reviews0:.0f} reviews")
