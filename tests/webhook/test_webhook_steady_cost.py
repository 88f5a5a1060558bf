"""What the webhook spends when nothing changes: others' pods it watches, templates that already exist, a review
of each kind (Python calls per review, counted in process: noise-free, unlike CPU time on a shared machine)."""

from __future__ import annotations

import asyncio
import cProfile
import pstats
from typing import Any

import orjson
import pytest
from aiohttp import StreamReader, web
from aiohttp.test_utils import make_mocked_request
from review_fixtures import review, secret

from gatekeeper.webhook import listwatch
from gatekeeper.webhook.app import build_app, mutate, validate
from gatekeeper.webhook.listwatch import watch_event
from gatekeeper.webhook.pod_refs import REFERENCE, PodTemplateRefs
from gatekeeper.webhook.settings import GpuSettings, ServerSettings, WebhookSettings
from gatekeeper.webhook.template_lifecycle import KubeOps, TemplateLifecycle
from gatekeeper.webhook.templates import TemplateKeeper


def _line(event: str, obj: dict[str, Any]) -> bytes:
    return orjson.dumps({"type": event, "object": obj})


def _pod(name: str, rv: str, template: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "pause"}]}
    if template:
        spec["resourceClaims"] = [{"name": "gpu-c", "resourceClaimTemplateName": template}]
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "a", "uid": "u", "resourceVersion": rv,
                         "annotations": {"resourceVersion": "1"}}, "spec": spec}


def test_a_pod_event_naming_no_template_is_not_decoded_and_the_watch_still_moves_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[bytes] = []
    real = orjson.loads

    def counting(data: bytes) -> Any:
        decoded.append(data)
        return real(data)

    monkeypatch.setattr(listwatch.orjson, "loads", counting)
    plain = [_line(e, _pod(f"p{i}", str(10 + i))) for i, e in enumerate(("ADDED", "MODIFIED", "DELETED"))]
    assert [watch_event(line, REFERENCE) for line in plain] == [
        ("BOOKMARK", {"metadata": {"resourceVersion": rv}}) for rv in ("10", "11", "12")]
    assert decoded == []
    gpu = _line("ADDED", _pod("g", "13", template="t"))
    error = _line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})
    assert watch_event(gpu, REFERENCE) == ("ADDED", _pod("g", "13", template="t"))
    assert watch_event(error, REFERENCE)[0] == "ERROR"
    assert watch_event(plain[0]) == ("ADDED", _pod("p0", "10"))  # a view that names no bytes gets every event
    assert decoded == [gpu, error, plain[0]]


def test_the_pod_index_follows_through_undecoded_events_and_resumes_after_the_last() -> None:
    lines = [_line("ADDED", _pod("g", "5", template="t")), _line("ADDED", _pod("p", "6")),
             _line("DELETED", _pod("p", "7")), _line("DELETED", _pod("g", "8", template="t")),
             _line("ADDED", _pod("q", "9"))]
    resumed: list[str] = []

    async def list_fn() -> tuple[list[dict[str, Any]], str]:
        return [], "4"

    async def watch_fn(rv: str) -> Any:
        resumed.append(rv)
        if len(resumed) > 1:
            raise asyncio.CancelledError
        for line in lines:
            yield watch_event(line, REFERENCE)

    refs = PodTemplateRefs(list_fn, watch_fn)
    seen: list[set[tuple[str, str]] | None] = []
    real_apply = refs.apply

    def apply(event: str, obj: dict[str, Any]) -> None:
        real_apply(event, obj)
        seen.append(refs.referenced())

    refs.apply = apply  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(refs.run())
    assert seen == [{("a", "t")}, set()]  # only the GPU pod's two events reached the index
    assert resumed == ["4", "9"] and refs.lists == 1


def _template(name: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "a", "labels": {"app.kubernetes.io/managed-by": "gatekeeper"},
                         "uid": "u"}, "spec": {"spec": {"devices": {}}}}


def test_a_template_that_exists_costs_a_review_no_api_call_and_no_loop_turn() -> None:
    posts: list[str] = []

    async def create(obj: dict[str, Any]) -> None:
        posts.append(obj["metadata"]["name"])

    async def play() -> None:
        keeper = TemplateKeeper(create)
        listed = [_template("t")]

        async def list_templates() -> list[dict[str, Any]]:
            return listed

        async def nothing(*_: Any) -> None:
            return None

        loop = TemplateLifecycle(KubeOps(list_templates, nothing, nothing), 30, 600, lambda: set(),
                                 forget=keeper.forget, seen=keeper.seen)
        await loop.once()  # another worker made it: the LIST shows it
        coro = keeper.ensure([_template("t")])
        with pytest.raises(StopIteration):
            coro.send(None)  # finished without suspending: no task, no loop turn
        listed.clear()
        await loop.once()  # deleted by someone: the next pod POSTs again
        await keeper.ensure([_template("t")])

    asyncio.run(play())
    assert posts == ["t"]


class _Protocol:
    _reading_paused = False
    connected = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


def _gpu_pod() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"},
            "spec": {"containers": [{"name": "c", "image": "pause", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


CALLS_PER_REVIEW = {"secret": 180, "gpu pod": 380}
"""Ceilings a little above what was measured (166 and 351; 176 and 476 before the template fast path, the
per-shape name cache and cached size limits): more means work per review came back."""


@pytest.mark.parametrize("kind", sorted(CALLS_PER_REVIEW))
def test_python_calls_per_review_stay_under_their_ceiling(kind: str) -> None:
    async def create(obj: dict[str, Any]) -> None:
        pass

    settings = WebhookSettings(server=ServerSettings(), gpu=GpuSettings(enabled=True, default_mode="dra"))
    app = build_app(settings, TemplateKeeper(create), authenticate=lambda r, s: "kube-apiserver")
    path, handler, doc = {"secret": ("/validate", validate, orjson.dumps(review(secret(data={"a": "eA=="})))),
                          "gpu pod": ("/mutate", mutate, orjson.dumps(review(_gpu_pod(), kind="Pod")))}[kind]

    def request() -> web.Request:
        stream = StreamReader(_Protocol(), 2**16, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
        stream.feed_data(doc)
        stream.feed_eof()
        return make_mocked_request("POST", path, headers={"Content-Length": str(len(doc)),
                                                          "Content-Type": "application/json"},
                                   payload=stream, app=app, client_max_size=app._client_max_size)

    async def play() -> float:
        for _ in range(3):  # first reviews: metric children, caches, the template's POST
            assert (await handler(request())).status == 200
        reqs = [request() for _ in range(50)]
        prof = cProfile.Profile()
        prof.enable()
        for r in reqs:
            await handler(r)
        prof.disable()
        return float(pstats.Stats(prof).total_calls) / 50  # type: ignore[attr-defined]

    calls = asyncio.run(play())
    assert calls <= CALLS_PER_REVIEW[kind], f"{calls:.0f} Python calls per {kind} review"
