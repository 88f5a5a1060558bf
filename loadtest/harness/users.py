"""Locust users that speak to kube-apiservers as tenants do: own identity, HTTP/2 where clients use it.

Each user is an ``httpx.Client`` (gevent-patched sockets, as Locust runs them)
and reports every request through Locust's ``request`` event, so Locust's own
statistics, CSV writer and percentiles do the counting. Users read their
parameters from ``environment.spec`` (the JSON the driver was given): targets
and identities are dealt round-robin by user index, so N users spread over the
apiservers and the tenants the way the scenario says.
"""

from __future__ import annotations

import base64
import itertools
import os
import random
import ssl
import time
import uuid
from typing import Any

import httpx
from locust import User, constant, constant_throughput, task
from locust.exception import StopUser

_index = itertools.count()


class K8sUser(User):
    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        self.spec: dict[str, Any] = self.environment.spec
        self.index = next(_index)
        targets = self.spec["targets"]
        ids = self.spec.get("identities") or [None]
        self.target = targets[self.index % len(targets)]
        ident = ids[self.index % len(ids)] if not self.target.startswith("http://") else None
        headers = {"accept": "application/json", "accept-encoding": "identity"}
        ctx = ssl.create_default_context(cafile=self.spec["ca"])
        if ident and ident["kind"] == "token":
            headers["authorization"] = f"Bearer {ident['token']}"
        elif ident:
            ctx.load_cert_chain(ident["cert"], ident["key"])
        self.client = httpx.Client(
            base_url=self.target, http2=bool(self.spec.get("http2")), verify=ctx,
            headers=headers, timeout=httpx.Timeout(float(self.spec.get("request_timeout", 300)), connect=10),
        )
        self.ns = self.spec["namespace"]

    def on_stop(self) -> None:
        self.client.close()

    def call(self, method: str, name: str, path: str, *, ok: tuple[int, ...] = (200, 201), stream: bool = False,
             **kw: Any) -> httpx.Response | None:
        """One request, reported to Locust; the response (body read) if its status is in ``ok``, else None."""
        t0 = time.perf_counter()
        exc: Exception | None = None
        resp: httpx.Response | None = None
        length = 0
        try:
            if stream:
                with self.client.stream(method, path, **kw) as resp:
                    for chunk in resp.iter_raw():
                        length += len(chunk)
            else:
                resp = self.client.request(method, path, **kw)
                length = len(resp.content)
            if resp.status_code not in ok:
                exc = RuntimeError(f"{resp.status_code} {resp.reason_phrase}")
        except httpx.HTTPError as e:
            exc = e
        self.environment.events.request.fire(
            request_type=method, name=name, response_time=(time.perf_counter() - t0) * 1000,
            response_length=length, exception=exc, context={"target": self.target}, response=resp,
        )
        return resp if exc is None else None

    def list_secrets(self, name: str, *, reflector: bool = False) -> None:
        """One full LIST of the namespace's Secrets as client-go makes it, reported as ``name`` with its waits.

        429 + Retry-After is retried (up to 10 times), each one reported as ``throttled (429)``. A LIST cut by
        an error (a proxy killed under it) is sent again after 1 s, as a reflector re-lists (``re-listed after
        an error``), up to 10 times; with ``reflector`` for as long as the run lasts, after client-go's
        reflector back-off (0.8 s doubling to 30 s)."""
        t0 = time.perf_counter()
        backoff = 0.8
        resp: httpx.Response | None = None
        for attempt in itertools.count():
            if attempt > 10 and not reflector:
                break
            resp = self.call("GET", "LIST secrets (one try)", f"/api/v1/namespaces/{self.ns}/secrets",
                             ok=(200, 429), stream=True)
            if resp is not None and resp.status_code == 429:
                self.environment.events.request.fire(
                    request_type="GET", name="throttled (429)", response_time=0, response_length=0,
                    exception=None, context={})
                time.sleep(float(resp.headers.get("retry-after", "1")))
                continue
            if resp is None:  # a connection cut (a proxy gone): the pool reconnects; re-list as a reflector does
                self.environment.events.request.fire(
                    request_type="GET", name="re-listed after an error", response_time=0, response_length=0,
                    exception=None, context={})
                time.sleep(backoff if reflector else 1.0)
                backoff = min(30.0, backoff * 2)
                continue
            break
        ok = resp is not None and resp.status_code == 200
        self.environment.events.request.fire(
            request_type="GET", name=name, response_time=(time.perf_counter() - t0) * 1000,
            response_length=0, exception=None if ok else RuntimeError("LIST did not complete"), context={})


class ListerUser(K8sUser):
    """The seeds' tenant: full LISTs of the namespace's Secrets (:meth:`K8sUser.list_secrets`), ``rounds``
    times, then it leaves; with ``relist: reflector`` a cut LIST is sent again for as long as the run lasts,
    so apiservers that come back meet the same storm, as in the seeds' incident.
    """

    @task
    def storm(self) -> None:
        for _ in range(int(self.spec.get("rounds", 1))):
            self.list_secrets("LIST secrets", reflector=self.spec.get("relist") == "reflector")
        raise StopUser()


class SteadyUser(K8sUser):
    """A long-lived client issuing small requests at a steady rate on one connection (HTTP/2 or kubectl
    proxy's), like a controller: the shape whose connections an L4 balancer pins.

    From wall-clock time ``storm_epoch`` on, its next ``storm_lists`` requests are full LISTs of the
    namespace's Secrets on that same connection: the seeds' LIST storm lands where the balancer pinned
    the connections, so the memory follows the connection skew."""

    def on_start(self) -> None:
        super().on_start()
        self.storms = 0

    def wait_time(self) -> float:
        return float(constant_throughput(float(self.spec.get("rate", 5)))(self))

    @task
    def get(self) -> None:
        at = self.spec.get("storm_epoch")
        if at is not None and self.storms < int(self.spec.get("storm_lists", 0)) and time.time() >= float(at):
            self.storms += 1
            self.list_secrets("LIST secrets (storm)")
            return
        self.call("GET", "LIST configmaps", f"/api/v1/namespaces/{self.ns}/configmaps?limit=1")


def create_pod(user: K8sUser, kind: str = "CREATE pod") -> None:
    """Create a Pod (timed as ``kind``), then delete it (not timed as admission)."""
    name = f"adm-{uuid.uuid4().hex[:10]}"
    body = gpu_pod(name) if kind == "CREATE gpu pod" else pod(name)
    if user.call("POST", kind, f"/api/v1/namespaces/{user.ns}/pods", json=body):
        user.call("DELETE", "DELETE pod", f"/api/v1/namespaces/{user.ns}/pods/{name}",
                  params={"gracePeriodSeconds": "0"})


def create_secret(user: K8sUser) -> None:
    """Create a 1 KiB Secret (timed), then delete it (not timed)."""
    name = f"adm-{uuid.uuid4().hex[:10]}"
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
            "data": {"k": base64.b64encode(os.urandom(1024)).decode()}}
    if user.call("POST", "CREATE secret", f"/api/v1/namespaces/{user.ns}/secrets", json=body):
        user.call("DELETE", "DELETE secret", f"/api/v1/namespaces/{user.ns}/secrets/{name}")


class CreateUser(K8sUser):
    """Admission traffic: create a Pod or a Secret (timed), then delete it (not timed as admission)."""

    @task
    def create_pod(self) -> None:
        create_pod(self)

    @task
    def create_secret(self) -> None:
        create_secret(self)


class AdmissionUser(CreateUser):
    """CreateUser plus GPU pods: plain pods never reach gatekeeper's mutating webhook (its
    matchConditions send only pods asking for ``nvidia.com/gpu``), GPU pods do and get rewritten."""

    @task
    def create_gpu_pod(self) -> None:
        create_pod(self, "CREATE gpu pod")


def wait_for_slot(user: K8sUser, i: int, start: list[float]) -> None:
    """An open-loop schedule: sleep until create ``i``'s slot, ``start + i / spec["rate"]``, then report how late
    it left as ``ramp lag`` (response time = lag in ms). ``start`` holds the schedule's origin, set by the first
    create for every user of the class (no yield between the check and the append: gevent)."""
    if not start:
        start.append(time.monotonic())
    delay = start[0] + i / float(user.spec["rate"]) - time.monotonic()
    if delay > 0:
        time.sleep(delay)  # gevent-patched in Locust's process: the other users go on
    user.environment.events.request.fire(
        request_type="RAMP", name="ramp lag", response_time=max(0.0, -delay) * 1000, response_length=0,
        exception=None, context={})


_rate_index = itertools.count()
_rate_start: list[float] = []


class RateAdmissionUser(K8sUser):
    """admission's fixed-rate phase: create ``i`` (a plain pod, a GPU pod, a Secret, in turn) is sent at
    ``start + i / spec["rate"]`` whatever the answers take, so both arms get the same creates at the same times
    (an open loop well under saturation: latency without queueing in the load generator). The users are only the
    creates in flight. How late each create left against its slot is ``ramp lag``, as in :class:`RampGpuPodUser`;
    a create late by more than its own interval means the generator, not the apiserver, set the pace."""

    @task
    def create_in_turn(self) -> None:
        i = next(_rate_index)
        wait_for_slot(self, i, _rate_start)
        if i % 3 == 2:
            create_secret(self)
        else:
            create_pod(self, ("CREATE pod", "CREATE gpu pod")[i % 3])


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "loadtest"}},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"requests": {"cpu": "10m"}}}]}}


def gpu_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "dra-scale"}},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


_ramp_index = itertools.count()
_ramp_start: list[float] = []


class RampGpuPodUser(K8sUser):
    """dra-scale's open-loop ramp: pod ``i`` is sent at ``start + i / spec["rate"]``, ``spec["total"]`` in all.

    Bounded-concurrency users (each creating its next pod when its last one was answered) create as fast as the
    apiserver answers, so an arm whose admission or writes are slower also gets a slower ramp, and the arms no
    longer see the same load. Here the
    schedule is fixed and every arm gets the same one; the users are only the requests in flight
    (``spec["users"]`` of them, enough for a few seconds of creates). How late each create left against its
    slot is reported as ``ramp lag`` (response time = lag in ms), so a report can show the ramp was kept.
    """

    @task
    def create(self) -> None:
        i = next(_ramp_index)
        if i >= int(self.spec["total"]):
            raise StopUser()
        wait_for_slot(self, i, _ramp_start)
        self.call("POST", "CREATE gpu pod", f"/api/v1/namespaces/{self.ns}/pods", json=gpu_pod(f"gpu-{i:06d}"))


class SteadyChurnUser(K8sUser):
    """gogc's tenant: churn at a constant object count, so that memory can only move with the GC, not the data.

    The scenario pre-creates ``spec["objects"]`` Secrets named ``steady-NNNNN``; user k owns those whose
    number is k modulo ``spec["users"]``. At ``spec["rate"]`` requests per second it mostly rewrites one
    of its Secrets' data (a fresh ``secret_bytes`` blob), and now and then (``replace_every``-th request)
    replaces one: creates a Secret under a new name, then deletes the old one, so the count moves by at most
    one per user and returns. Every ``list_every`` seconds, first after a random offset so the users do not
    LIST in step, it LISTs all the namespace's Secrets, the read that grows an apiserver's heap. A constant
    rate, not a closed loop, so both GOGC arms carry the same load and CPU per request compares like with
    like; it leaves when ``stop_file`` exists, which ends the driver's ``until_done`` run.
    """

    def wait_time(self) -> float:
        return float(constant_throughput(float(self.spec.get("rate", 4)))(self))

    def on_start(self) -> None:
        super().on_start()
        users, objects = int(self.spec["users"]), int(self.spec["objects"])
        self.mine = [f"steady-{i:05d}" for i in range(objects) if i % users == self.index % users]
        self.size = int(self.spec.get("secret_bytes", 64 * 1024))
        self.every = float(self.spec.get("list_every", 10))
        self.next_list = time.monotonic() + random.uniform(0, self.every)
        self.sent = 0
        self.stop_file = str(self.spec.get("stop_file", ""))

    def _secret(self, name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": {"app": "steady"}},
                "data": {"blob": base64.b64encode(os.urandom(self.size)).decode()}}

    @task
    def churn(self) -> None:
        if self.stop_file and os.path.exists(self.stop_file):
            raise StopUser()
        base = f"/api/v1/namespaces/{self.ns}/secrets"
        if time.monotonic() >= self.next_list:
            self.next_list += self.every
            self.call("GET", "LIST secrets", base, stream=True)
            return
        if not self.mine:
            return
        self.sent += 1
        slot = random.randrange(len(self.mine))
        old = self.mine[slot]
        if self.sent % int(self.spec.get("replace_every", 20)):
            self.call("PUT", "UPDATE secret", f"{base}/{old}", json=self._secret(old))
            return
        new = f"steady-r-{uuid.uuid4().hex[:10]}"
        if self.call("POST", "CREATE secret (replace)", base, json=self._secret(new)):
            self.mine[slot] = new
            self.call("DELETE", "DELETE secret (replace)", f"{base}/{old}")
