"""KEP-5004: with a DeviceClass mapping nvidia.com/gpu, plain ``dra`` leaves what the scheduler serves alone."""

from __future__ import annotations

import asyncio
from typing import Any

from review_fixtures import container, pod, request, review

from gatekeeper.webhook.deviceclasses import ExtendedResourceMap, classes_mapping
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.settings import GpuSettings

DRA = GpuSettings(default_mode="dra", kep5004="step-aside")
"""The step-aside these tests are about is opt-in (``gpu.kep5004``; test_gpu_kep5004_setting.py has the default)."""


def decide(obj: dict[str, Any], mapped: bool, settings: GpuSettings = DRA, **kw: Any) -> Any:
    return gpu.review(request(review(obj, kind="Pod", **kw)), settings, mapped)


def test_mapped_one_gpu_dra_pod_is_left_alone_with_a_warning_naming_kep_5004() -> None:
    d = decide(pod(container("c", 1)), mapped=True)
    assert d.outcome == "skipped" and not d.patch and not d.templates
    assert any("KEP-5004" in w for w in d.warnings)
    assert d.audit["gpu-mode-source"] == "default"


def test_without_a_mapping_the_same_pod_is_rewritten() -> None:
    d = decide(pod(container("c", 1)), mapped=False)
    assert d.outcome == "mutated" and d.templates


def test_mapped_multi_gpu_pod_still_gets_its_alignment_claim() -> None:
    d = decide(pod(container("c", 4)), mapped=True)
    assert d.outcome == "mutated"
    (req,) = d.templates[0]["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"]["count"] == 4
    assert d.templates[0]["spec"]["spec"]["devices"]["constraints"]


def test_mapped_pod_above_align_up_to_is_left_to_the_scheduler() -> None:
    assert decide(pod(container("c", 8)), mapped=True).outcome == "skipped"


def test_mapped_shared_pods_are_still_rewritten_for_their_memory() -> None:
    s = GpuSettings(default_mode="shared", shared_default_memory="8Gi")
    d = decide(pod(container("c", 1)), mapped=True, settings=s)
    assert d.outcome == "mutated"
    assert d.templates[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]


def test_classes_mapping_finds_only_classes_naming_the_gpu_resource() -> None:
    items = [{"metadata": {"name": "a"}, "spec": {"extendedResourceName": "nvidia.com/gpu"}},
             {"metadata": {"name": "b"}, "spec": {"extendedResourceName": "example.com/fpga"}},
             {"metadata": {"name": "c"}, "spec": {}}, "junk", {"metadata": {"name": "d"}}]
    assert classes_mapping(items) == ["a"]  # type: ignore[arg-type]


def test_map_follows_changes_and_keeps_the_last_answer_when_listing_fails() -> None:
    answers: list[Any] = [[{"metadata": {"name": "a"}, "spec": {"extendedResourceName": "nvidia.com/gpu"}}],
                          RuntimeError("apiserver down"), []]

    async def lister() -> list[dict[str, Any]]:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return list(a)

    async def scenario() -> list[bool]:
        m = ExtendedResourceMap(lister, interval=0.01)
        seen = []
        for _ in range(3):
            await m.refresh()
            seen.append(m.mapped)
        return seen

    assert asyncio.run(scenario()) == [True, True, False]


def test_namespace_label_sets_the_mode_where_the_config_says_nothing() -> None:
    from gatekeeper.webhook import policies
    from gatekeeper.webhook.settings import WebhookSettings

    s = GpuSettings(default_mode="dra", namespace_modes={"cfg": "off"})
    d = gpu.review(request(review(pod(container("c", 1)), kind="Pod", namespace="lab")), s, False, "time-slicing")
    assert d.outcome == "mutated" and d.audit["gpu-mode"] == "time-slicing"
    assert d.audit["gpu-mode-source"] == "namespace-label"
    # the operator's namespaceModes wins over the label
    d = gpu.review(request(review(pod(container("c", 1)), kind="Pod", namespace="cfg")), s, False, "dra")
    assert d.outcome == "skipped" and d.audit["gpu-mode-source"] == "namespace"
    # policies.mutate looks the pod's namespace up in the cache's map
    ws = WebhookSettings(gpu=s)
    _, d = policies.mutate(request(review(pod(container("c", 1)), kind="Pod", namespace="lab")), ws,
                           namespace_modes={"lab": "off"})
    assert d.outcome == "skipped" and d.audit["gpu-mode-source"] == "namespace-label"


def test_namespace_label_with_no_such_mode_denies_with_the_fix() -> None:
    d = gpu.review(request(review(pod(container("c", 1)), kind="Pod", namespace="lab")), DRA, False, "fast")
    assert not d.allowed and "fix the namespace's label" in (d.message or "")


def test_namespace_cache_follows_list_watch_events_and_relists_after_an_error() -> None:
    from gatekeeper.webhook.namespace_modes import NamespaceModes

    def ns(name: str, mode: str | None) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {"gatekeeper.dev/gpu-mode": mode} if mode else {}}}

    lists = [([ns("a", "dra")], "1"), ([ns("c", "mig")], "9")]
    streams = [[("MODIFIED", ns("a", "shared")), ("ADDED", ns("b", "off")), ("MODIFIED", ns("b", None)),
                ("ERROR", {})], []]
    seen: list[dict[str, str]] = []

    async def list_ns() -> tuple[list[dict[str, Any]], str]:
        return lists.pop(0)

    async def watch_ns(rv: str) -> Any:
        events = streams.pop(0)
        if not streams:
            done.set()  # the second watch, after the relist
        for ev in events:
            yield ev
            seen.append(dict(cache.modes))

    async def scenario() -> dict[str, str]:
        task = asyncio.create_task(cache.run())
        await asyncio.wait_for(done.wait(), 5)
        task.cancel()
        return dict(cache.modes)

    cache = NamespaceModes(list_ns, watch_ns, retry_seconds=0.01)
    done = asyncio.Event()
    final = asyncio.run(scenario())
    assert seen[:3] == [{"a": "shared"}, {"a": "shared", "b": "off"}, {"a": "shared"}]
    assert final == {"c": "mig"}  # the ERROR event led to a fresh LIST
