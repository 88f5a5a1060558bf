"""What one tenant cannot do to every other client through the proxy (real apiservers, a tenant token).

Blame an apiserver. The balancer ejects a backend at once when a request fails there before an answer
(``BackendFailed``: reported like a failed connect), and on a 5xx storm. On the multiplexed HTTP/2
upstream, kube-apiserver (Go's HTTP/2 server) answers some requests it cannot parse with RST_STREAM
PROTOCOL_ERROR instead of a response: a ``:path`` with a malformed percent escape
(``url.ParseRequestURI`` fails), or a header value with a control byte
(``httpguts.ValidHeaderFieldValue``). Such a request from any ServiceAccount token flow control verified
(any pod's token) used to eject the apiserver it landed on, one request per apiserver. Over HTTP/1.1 the
same bytes get a 400 from Go's server, which is what the proxy now answers itself, before any backend
call. 5xx a tenant decides (a proxy subresource's backend, an aggregated API that is down, a failing
admission webhook on its own writes) made 5xx storms that ejected every apiserver but one.

Hold the long-running pool. Watches run outside every seat once set up; one caller holds at most
``upstream.maxLongRunningPerCaller`` of them (and followed logs, exec, port-forward) open.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import Kubectl, ProxyProcess, metric_sum
from gatekeeper.sandbox.with_proxy import IDENTITY_RBAC, default_flow_control

pytestmark = pytest.mark.sandbox
LONG_RUNNING_CAP = 3


@pytest.fixture(scope="module")
def tenant(sandbox: SandboxState, kubectl: Kubectl) -> Iterator[tuple[str, str]]:
    """A namespace with a ServiceAccount that may read it, and that ServiceAccount's token."""
    ns = f"tenant-{secrets.token_hex(3)}"
    kubectl("apply", "-f", "-", input=IDENTITY_RBAC.read_text(), check=True)
    kubectl("create", "namespace", ns, check=True)
    for sa in ("reader", "neighbour"):
        kubectl("-n", ns, "create", "serviceaccount", sa, check=True)
        kubectl("-n", ns, "create", "rolebinding", sa, "--clusterrole=view", f"--serviceaccount={ns}:{sa}",
                check=True)
    kubectl("-n", ns, "create", "role", "proxier", "--verb=get", "--resource=services/proxy", check=True)
    kubectl("-n", ns, "create", "rolebinding", "proxier", "--role=proxier", f"--serviceaccount={ns}:reader",
            check=True)
    kubectl("-n", ns, "create", "service", "clusterip", "nobody-home", "--tcp=80:80", check=True)  # no endpoints
    token = kubectl("-n", ns, "create", "token", "reader", "--duration=1h", check=True).stdout.strip()
    try:
        yield ns, token
    finally:
        kubectl("delete", "namespace", ns, "--wait=false")


@pytest.fixture(scope="module")
def proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    # Probes every 30 s: a probe would lift a connect-failure ejection within its interval; the
    # counter below sees an ejection either way.
    p = ProxyProcess(sandbox, tmp_path_factory.mktemp("tenant-proxy"), name="tenant-proxy", health_interval=30,
                     user_config={"flowControl": default_flow_control(),
                                  "upstream": {"maxLongRunningPerCaller": LONG_RUNNING_CAP}})
    p.start()
    yield p
    assert p.stop() == 0


def ca_context(state: SandboxState) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))


async def ejections_during(client: httpx.AsyncClient, proxy: ProxyProcess,
                           send: Callable[[int], Awaitable[httpx.Response | None]],
                           count: int) -> tuple[list[int], float]:
    """The statuses of ``send(0..count-1)``, one after another (0 for a stream the proxy cut), and the backend
    ejections the proxy counted meanwhile (from its own metrics)."""
    before = (await client.get(f"{proxy.metrics_url}/metrics")).text
    statuses = [0 if (response := await send(i)) is None else response.status_code for i in range(count)]
    after = (await client.get(f"{proxy.metrics_url}/metrics")).text
    return statuses, (metric_sum(after, "gatekeeper_proxy_backend_ejections_total")
                      - metric_sum(before, "gatekeeper_proxy_backend_ejections_total"))


async def test_a_tenants_malformed_requests_never_eject_an_apiserver(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str]) -> None:
    ns, token = tenant
    good = {"authorization": f"Bearer {token}"}
    base = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps"
    async with httpx.AsyncClient(verify=ca_context(sandbox), http2=True, timeout=30) as client:
        for _ in range(100):  # the RoleBinding reaches the apiservers' RBAC caches within moments
            if (await client.get(base, headers=good)).status_code == 200:
                break
            await asyncio.sleep(0.1)
        before = (await client.get(f"{proxy.metrics_url}/metrics")).text
        statuses: list[int | str] = []
        for i in range(3 * len(sandbox.apiserver_urls)):
            bad_escape = await client.get(f"{base}/x%zz{i}", headers=good)
            statuses.append(bad_escape.status_code)
            try:  # refused as Go's HTTP/2 server refuses it: this stream reset, the connection goes on
                control = await client.get(base, headers={**good, "x-note": f"a\x01b{i}"})
                statuses.append(control.status_code)
            except httpx.RemoteProtocolError:
                statuses.append("reset")
        after = (await client.get(f"{proxy.metrics_url}/metrics")).text
        still = await client.get(base, headers=good)
    assert still.status_code == 200
    assert statuses == [400, "reset"] * 3 * len(sandbox.apiserver_urls), statuses
    assert metric_sum(after, "gatekeeper_proxy_rejected_total", reason="bad_escape") >= len(statuses) // 2
    ejections = (metric_sum(after, "gatekeeper_proxy_backend_ejections_total")
                 - metric_sum(before, "gatekeeper_proxy_backend_ejections_total"))
    assert ejections == 0
    upstream_errors = (metric_sum(after, "gatekeeper_proxy_upstream_errors_total")
                       - metric_sum(before, "gatekeeper_proxy_upstream_errors_total"))
    assert upstream_errors == 0


async def test_503s_a_tenant_relays_through_a_proxy_subresource_never_eject_an_apiserver(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str]) -> None:
    """A service, pod or node ``proxy`` answer is the tenant's backend's status, not the apiserver's health.

    A Service without endpoints is answered 503 at once by the apiserver (a tenant's own pod could answer
    503 to everything as well); counted by the 5xx storm detector, 20 of them in 10 s made the quiet
    sandbox's apiservers look like a storm and ejected all but the last one: every other client's
    request then went to that one apiserver (the seeds' incident, on demand).
    """
    ns, token = tenant
    good = {"authorization": f"Bearer {token}"}
    relay = f"{proxy.url}/api/v1/namespaces/{ns}/services/nobody-home:80/proxy/"
    async with httpx.AsyncClient(verify=ca_context(sandbox), http2=True, timeout=30) as client:
        for _ in range(100):  # the Role reaches the apiservers' RBAC caches within moments
            if (await client.get(relay, headers=good)).status_code == 503:
                break
            await asyncio.sleep(0.1)
        statuses, ejections = await ejections_during(
            client, proxy, lambda _: client.get(relay, headers=good), 20 * len(sandbox.apiserver_urls))
    assert set(statuses) == {503}, statuses
    assert ejections == 0


async def test_504s_of_a_deadline_the_tenant_picked_never_eject_an_apiserver(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str]) -> None:
    """``?timeout=1ns`` makes kube-apiserver answer a core-group GET 504 at once (its request-deadline filter
    runs before authentication): the apiserver's own answer, but to a deadline the caller chose. Counted as a
    5xx storm, 20 per apiserver ejected all but the last one."""
    ns, token = tenant
    good = {"authorization": f"Bearer {token}"}
    base = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps"
    async with httpx.AsyncClient(verify=ca_context(sandbox), http2=True, timeout=30) as client:
        for _ in range(100):  # the RoleBinding reaches the apiservers' RBAC caches within moments
            if (await client.get(base, headers=good)).status_code == 200:
                break
            await asyncio.sleep(0.1)
        count = 20 * len(sandbox.apiserver_urls)

        async def past_its_deadline(_: int) -> httpx.Response | None:
            try:
                return await client.get(f"{base}?timeout=1ns", headers=good)
            except httpx.RemoteProtocolError:  # the proxy's own sweep met the 1 ns deadline mid-answer: cut
                return None

        statuses, ejections = await ejections_during(client, proxy, past_its_deadline, count)
        still = await client.get(base, headers=good)
    assert still.status_code == 200
    assert statuses.count(504) >= count // 2, statuses  # the apiserver's own 504s, relayed
    assert ejections == 0


APISERVICE = """apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata:
  name: v1.blame.gatekeeper.test
spec:
  group: blame.gatekeeper.test
  version: v1
  groupPriorityMinimum: 100
  versionPriority: 10
  insecureSkipTLSVerify: true
  service:
    namespace: {ns}
    name: nobody-home
    port: 80
"""


async def test_503s_of_an_unavailable_aggregated_api_never_eject_an_apiserver(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str], kubectl: Kubectl) -> None:
    """An APIService whose server is down (metrics-server, a stale registration) is answered 503 by every
    apiserver at once, to any authenticated caller (``system:discovery`` lets everyone read ``/apis/*``):
    that is the aggregated server's state, not the apiservers' health."""
    ns, token = tenant
    good = {"authorization": f"Bearer {token}"}
    kubectl("apply", "-f", "-", input=APISERVICE.format(ns=ns), check=True)
    try:
        discovery = f"{proxy.url}/apis/blame.gatekeeper.test/v1"
        async with httpx.AsyncClient(verify=ca_context(sandbox), http2=True, timeout=30) as client:
            for _ in range(300):  # each apiserver's aggregator picks the APIService up within moments
                if [(await client.get(discovery, headers=good)).status_code for _ in range(6)] == [503] * 6:
                    break
                await asyncio.sleep(0.1)
            statuses, ejections = await ejections_during(
                client, proxy, lambda _: client.get(discovery, headers=good), 20 * len(sandbox.apiserver_urls))
    finally:
        kubectl("delete", "apiservice", "v1.blame.gatekeeper.test", "--wait=false")
    assert set(statuses) == {503}, statuses
    assert ejections == 0


async def test_one_caller_holds_at_most_its_share_of_watches_and_the_neighbours_still_watch(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str], kubectl: Kubectl) -> None:
    """Past ``maxLongRunningPerCaller`` open watches, the caller's next one is a 429 whichever of its tokens it
    sends (flow control's verified identity is the caller); another ServiceAccount's watch is served."""
    ns, token = tenant
    second_token = kubectl("-n", ns, "create", "token", "reader", "--duration=1h", check=True).stdout.strip()
    neighbour = kubectl("-n", ns, "create", "token", "neighbour", "--duration=1h", check=True).stdout.strip()
    watch = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps?watch=1&timeoutSeconds=120"
    async with httpx.AsyncClient(verify=ca_context(sandbox), http2=True, timeout=30) as client, \
            contextlib.AsyncExitStack() as open_watches:
        for _ in range(100):  # the RoleBindings reach the apiservers' RBAC caches within moments
            if (await client.get(f"{proxy.url}/api/v1/namespaces/{ns}/configmaps",
                                 headers={"authorization": f"Bearer {neighbour}"})).status_code == 200:
                break
            await asyncio.sleep(0.1)
        before = (await client.get(f"{proxy.metrics_url}/metrics")).text
        statuses = []
        for i in range(LONG_RUNNING_CAP + 1):
            auth = {"authorization": f"Bearer {token if i % 2 else second_token}"}
            response = await open_watches.enter_async_context(client.stream("GET", watch, headers=auth))
            statuses.append(response.status_code)
        theirs = await open_watches.enter_async_context(
            client.stream("GET", watch, headers={"authorization": f"Bearer {neighbour}"}))
        after = (await client.get(f"{proxy.metrics_url}/metrics")).text
    assert statuses == [200] * LONG_RUNNING_CAP + [429], statuses
    assert theirs.status_code == 200
    assert (metric_sum(after, "gatekeeper_proxy_rejected_total", reason="long_running_cap")
            - metric_sum(before, "gatekeeper_proxy_rejected_total", reason="long_running_cap")) == 1


WEBHOOK = """apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: {ns}-down
webhooks:
- name: down.{ns}.gatekeeper.test
  admissionReviewVersions: [v1]
  sideEffects: None
  failurePolicy: Fail
  timeoutSeconds: 1
  clientConfig:
    service: {{namespace: {ns}, name: nobody-home, port: 443}}
  namespaceSelector:
    matchLabels: {{kubernetes.io/metadata.name: {ns}}}
  rules:
  - {{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [configmaps]}}
"""


async def test_500s_of_a_failing_admission_webhook_never_eject_an_apiserver(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str], kubectl: Kubectl) -> None:
    """A webhook that cannot be called (failurePolicy Fail) makes every apiserver answer the writes it
    matches with 500 InternalError: the webhook's state, shared by every apiserver, that ejecting one only
    moves its load to the others. A tenant's writes into its own namespace meet it as often as it likes."""
    ns, _ = tenant
    kubectl("-n", ns, "create", "rolebinding", "writer", "--clusterrole=edit", f"--serviceaccount={ns}:neighbour",
            check=True)
    token = kubectl("-n", ns, "create", "token", "neighbour", "--duration=1h", check=True).stdout.strip()
    good = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    kubectl("apply", "-f", "-", input=WEBHOOK.format(ns=ns), check=True)
    try:
        url = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps"

        def body(i: int) -> str:
            return f'{{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"w{i}"}}}}'

        async with httpx.AsyncClient(verify=ca_context(sandbox), http2=True, timeout=30) as client:
            for i in range(300):  # RBAC and the webhook configuration reach every apiserver within moments
                if [(await client.post(url, content=body(i), headers=good)).status_code
                        for _ in range(6)] == [500] * 6:
                    break
                await asyncio.sleep(0.1)
            statuses, ejections = await ejections_during(
                client, proxy, lambda i: client.post(url, content=body(i), headers=good),
                20 * len(sandbox.apiserver_urls))
    finally:
        kubectl("delete", "validatingwebhookconfiguration", f"{ns}-down", "--wait=false")
    assert set(statuses) == {500}, statuses
    assert ejections == 0
