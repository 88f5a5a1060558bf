"""The template lifecycle's decisions: re-create what pods still use, collect what nobody uses after a grace."""

from __future__ import annotations

import asyncio
from typing import Any

from gatekeeper.webhook.template_lifecycle import KubeOps, LifecycleState, TemplateLifecycle, plan
from gatekeeper.webhook.templates import TemplateKeeper

OURS = {"app.kubernetes.io/managed-by": "gatekeeper"}


def tmpl(name: str, ns: str = "a", labels: dict[str, str] | None = OURS, uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "labels": labels, "uid": uid,
                         "resourceVersion": "7"}, "spec": {"spec": {"devices": {}}}}


def pod(*templates: str, ns: str = "a") -> dict[str, Any]:
    return {"metadata": {"namespace": ns},
            "spec": {"resourceClaims": [{"name": f"c{i}", "resourceClaimTemplateName": t}
                                        for i, t in enumerate(templates)]}}


def test_deleted_template_still_referenced_is_recreated_from_its_last_known_spec() -> None:
    st = LifecycleState()
    assert not plan(st, [tmpl("t")], [pod("t")], now=0, grace=60).recreate
    p = plan(st, [], [pod("t")], now=1, grace=60)
    (obj,) = p.recreate
    assert obj["metadata"] == {"name": "t", "namespace": "a", "labels": OURS}  # no uid/resourceVersion
    assert obj["spec"] == tmpl("t")["spec"]


def test_unreferenced_template_is_collected_only_after_the_grace_period() -> None:
    st = LifecycleState()
    assert not plan(st, [tmpl("t")], [], now=0, grace=60).delete
    assert not plan(st, [tmpl("t")], [], now=59, grace=60).delete
    assert plan(st, [tmpl("t")], [], now=60, grace=60).delete == [(("a", "t"), "u1")]


def test_a_new_reference_resets_the_grace_period() -> None:
    st = LifecycleState()
    plan(st, [tmpl("t")], [], now=0, grace=60)
    plan(st, [tmpl("t")], [pod("t")], now=30, grace=60)
    assert not plan(st, [tmpl("t")], [], now=70, grace=60).delete
    assert plan(st, [tmpl("t")], [], now=130, grace=60).delete


def test_recently_ensured_template_is_spared_and_foreign_ones_are_never_touched() -> None:
    st = LifecycleState()
    st.ensured_at[("a", "t")] = 100
    plan(st, [tmpl("t"), tmpl("f", labels={"x": "y"})], [], now=0, grace=60)
    assert not plan(st, [tmpl("t"), tmpl("f", labels={"x": "y"})], [], now=120, grace=60).delete
    assert [k for k, _ in plan(st, [tmpl("t"), tmpl("f", labels=None)], [], now=161, grace=60).delete] == [("a", "t")]
    assert not plan(LifecycleState(), [], [pod("f")], now=0, grace=60).recreate  # spec never seen


def test_loop_forgets_the_admission_cache_entry_of_a_deleted_template() -> None:
    created: list[str] = []

    async def create(obj: dict[str, Any]) -> None:
        created.append(obj["metadata"]["name"])

    async def scenario() -> tuple[bool, bool]:
        keeper = TemplateKeeper(create, cache_seconds=3600)
        templates: list[dict[str, Any]] = [tmpl("t")]

        async def lt() -> list[dict[str, Any]]:
            return list(templates)

        async def lp() -> list[dict[str, Any]]:
            return [pod("t")]

        async def delete(key: Any, uid: str) -> None:
            return None

        life = TemplateLifecycle(KubeOps(lt, lp, create, delete), 1, 60, forget=keeper.forget)
        keeper.on_ensured = life.ensured
        await keeper.ensure([tmpl("t")])
        before = keeper.known("a", "t")
        templates.clear()  # someone deletes it
        await life.once()
        return before, keeper.known("a", "t")

    assert asyncio.run(scenario()) == (True, False)
    assert created == ["t", "t"]  # admission's create, then the loop's re-create
