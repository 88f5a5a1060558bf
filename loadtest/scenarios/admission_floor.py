"""The admission scenario's floor: a webhook that decides nothing, registered exactly where gatekeeper's are.

What a create pays for a webhook has two parts: the apiserver calling any webhook at all (encode the object into an
AdmissionReview, a TLS round trip, decode the answer, for a mutating one apply the patch) and what the webhook
itself takes to answer. ``noopwebhook`` (``gatekeeper/sandbox/gomod/informers/noopwebhook``, Go's own TLS server)
answers every review "allowed" with no patch, so its arm measures the first part alone; gatekeeper's arm over it is
the second. Its configurations are gatekeeper's own (same rules, ``matchConditions``, timeouts, failure policy)
with the URLs pointed at it and the webhooks renamed ``*.noop.gatekeeper.dev``, so the apiservers' own
``apiserver_admission_webhook_admission_duration_seconds`` tells the arms apart and times every call.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gatekeeper.sandbox import kubectl
from gatekeeper.sandbox.build import noop_webhook_binary
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError

NOOP_SUFFIX = ".noop.gatekeeper.dev"
WEBHOOK_SECONDS = "apiserver_admission_webhook_admission_duration_seconds"


@contextlib.contextmanager
def noop_server(state: SandboxState, work: Path) -> Iterator[str]:
    """Run ``noopwebhook`` with the sandbox webhook's serving certificate (the configurations' caBundle already
    trusts it); yields its base URL."""
    certs = Path(state.certs_dir)
    port_file = work / "noopwebhook.port"
    port_file.unlink(missing_ok=True)
    log = (work / "noopwebhook.log").open("w")
    proc = subprocess.Popen([str(noop_webhook_binary()), "--address", "127.0.0.1:0",
                             "--cert", str(certs / "webhook-serving.crt"), "--key", str(certs / "webhook-serving.key"),
                             "--port-file", str(port_file)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ScenarioError(f"noopwebhook did not start (exit {proc.poll()}); log {log.name}")
            time.sleep(0.1)
        yield f"https://127.0.0.1:{int(port_file.read_text())}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def noop_configs(saved: Sequence[dict[str, Any]], base_url: str) -> list[dict[str, Any]]:
    """Gatekeeper's configurations with every webhook's URL on ``base_url`` (same path) and its name marked noop."""
    out = copy.deepcopy(list(saved))
    for cfg in out:
        for hook in cfg["webhooks"]:
            url = hook["clientConfig"].get("url")
            if not url:
                raise ScenarioError(f"{cfg['metadata']['name']}: the sandbox's webhooks are called by URL")
            path = "/" + url.split("://", 1)[1].partition("/")[2]
            hook["clientConfig"]["url"] = base_url.rstrip("/") + path
            hook["name"] = hook["name"].removesuffix(".gatekeeper.dev") + NOOP_SUFFIX
    return out


def webhook_calls(state: SandboxState, names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per webhook name, (seconds, calls) summed over every apiserver, as the apiservers time them."""
    out = dict.fromkeys(names, (0.0, 0.0))
    for url in state.apiserver_urls:
        with cluster.admin(state, url, timeout=10) as c:
            text = c.get("/metrics").text
        for name in names:
            s, n = out[name]
            out[name] = (s + _by_name(text, f"{WEBHOOK_SECONDS}_sum", name),
                         n + _by_name(text, f"{WEBHOOK_SECONDS}_count", name))
    return out


def _by_name(text: str, metric: str, name: str) -> float:
    """Sum of ``metric``'s samples labelled ``name="<name>"`` (the shared metric_sum takes ``name`` itself)."""
    label = f'name="{name}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(metric + "{") and label in line.partition("}")[0])


def webhook_names(saved: Sequence[dict[str, Any]]) -> list[str]:
    """Gatekeeper's webhook names and their noop twins."""
    names = [hook["name"] for cfg in saved for hook in cfg["webhooks"]]
    return names + [n.removesuffix(".gatekeeper.dev") + NOOP_SUFFIX for n in names]


def calls_between(before: dict[str, tuple[float, float]],
                  after: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Per webhook name, (mean ms per call, calls) over the interval; names with no call left out."""
    out = {}
    for name, (s1, n1) in after.items():
        s0, n0 = before.get(name, (0.0, 0.0))
        if n1 > n0:
            out[name] = ((s1 - s0) / (n1 - n0) * 1000, n1 - n0)
    return out


def noop_answers(state: SandboxState, kubeconfig: str) -> bool:
    """A dry-run Secret create through ``kubeconfig``'s apiserver reaches the noop validating webhook."""
    name = "secrets" + NOOP_SUFFIX
    before = webhook_calls(state, [name])[name][1]
    kubectl.run(kubeconfig, "create", "secret", "generic", "noop-probe", "--from-literal=k=v", "--dry-run=server",
                "-n", "default", binary=state.extra.get("kubectl"))
    return webhook_calls(state, [name])[name][1] > before
