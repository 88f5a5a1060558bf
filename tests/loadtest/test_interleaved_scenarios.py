"""skew and admission on the interleaved method without a sandbox: verdicts from fixed thresholds, arms named."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_skew_verdicts_judge_every_run_and_say_when_ranges_overlap() -> None:
    from loadtest.scenarios.skew_report import EVEN, SKEWED, verdicts

    assert SKEWED > EVEN
    runs = [("haproxy", 1.9), ("haproxy-goaway", 1.5), ("haproxy-goaway-0.02", 1.6), ("gatekeeper", 1.25),
            ("haproxy", 1.7), ("haproxy-goaway", 1.4), ("haproxy-goaway-0.02", 1.8), ("gatekeeper", 1.35)]
    lines = verdicts([{"arm": arm, "skew": skew} for arm, skew in runs])
    assert lines == [
        "- HAProxy TCP leaves a memory skew (peak RSS max/min >= 1.5 in every run): **holds**: 1.80 [1.70-1.90]",
        "- haproxy-goaway skews less than HAProxy TCP in every run: **holds**: 1.45 [1.40-1.50] against "
        "1.80 [1.70-1.90]",
        "- haproxy-goaway-0.02 skews less than HAProxy TCP in every run: **not distinguished (the runs' ranges "
        "overlap)**: 1.70 [1.60-1.80] against 1.80 [1.70-1.90]",
        "- gatekeeper keeps the apiservers even (peak RSS max/min <= 1.3 in every run): **not distinguished "
        "(1 of 2 runs keep it)**: 1.30 [1.25-1.35]",
        "- gatekeeper skews less than HAProxy TCP in every run: **holds**: 1.30 [1.25-1.35] against "
        "1.80 [1.70-1.90]",
        "- --goaway-chance=0.02 skews less than 0.001 in every run: **fails**",
    ]


def test_an_unknown_skew_arm_is_named_before_any_sandbox_starts() -> None:
    from loadtest.harness.cluster import ScenarioError
    from loadtest.harness.run import RunContext
    from loadtest.scenarios import skew

    with pytest.raises(ScenarioError, match="unknown arms nowhere"):
        skew.run(RunContext(out=Path("/nonexistent"), arms=("haproxy", "nowhere")))


def test_admission_ratios_are_taken_within_a_round_with_plain_pods_as_the_control() -> None:
    from loadtest.scenarios.admission import OWN_BOUND, ratios

    def run(arm: str, round_: int, pod: float, gpu: float, secret: float) -> dict[str, object]:
        rows = {n: {"Average Response Time": str(v)}
                for n, v in (("CREATE pod", pod), ("CREATE gpu pod", gpu), ("CREATE secret", secret))}
        return {"arm": arm, "round": round_, "rows": rows}

    results = [run("webhooks-off", 1, 100, 100, 100), run("webhooks-on", 1, 110, 143, 121),
               run("webhooks-off", 2, 200, 200, 100), run("webhooks-on", 2, 200, 240, 130),
               run("webhooks-off", 3, 100, 100, 100)]  # an unfinished round counts for nothing
    got = ratios(results)
    assert got["CREATE gpu pod"] == pytest.approx([1.43, 1.2])
    assert got["own CREATE gpu pod"] == pytest.approx([1.3, 1.2])
    assert got["own CREATE secret"] == pytest.approx([1.1, 1.3])
    assert got["CREATE pod"] == pytest.approx([1.1, 1.0]) and OWN_BOUND == 1.25


def test_an_unknown_admission_arm_is_named_before_any_sandbox_starts() -> None:
    from loadtest.harness.cluster import ScenarioError
    from loadtest.harness.run import RunContext
    from loadtest.scenarios import admission

    with pytest.raises(ScenarioError, match="unknown arms webhooks-maybe"):
        admission.run(RunContext(out=Path("/nonexistent"), arms=("webhooks-off", "webhooks-maybe")))


def test_the_noop_arm_registers_gatekeepers_own_rules_under_its_own_names_and_url() -> None:
    from loadtest.harness.cluster import ScenarioError
    from loadtest.scenarios.admission_floor import NOOP_SUFFIX, noop_configs, webhook_names

    saved = [{"metadata": {"name": "gatekeeper-gpu"},
              "webhooks": [{"name": "gpu.gatekeeper.dev", "matchConditions": [{"name": "asks-for-gpu"}],
                            "clientConfig": {"url": "https://127.0.0.1:4443/mutate", "caBundle": "Q0E="}}]}]
    got = noop_configs(saved, "https://127.0.0.1:9999/")
    hook = got[0]["webhooks"][0]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:9999/mutate", "caBundle": "Q0E="}
    assert hook["name"] == "gpu" + NOOP_SUFFIX and hook["matchConditions"] == [{"name": "asks-for-gpu"}]
    assert saved[0]["webhooks"][0]["name"] == "gpu.gatekeeper.dev"  # gatekeeper's own stay as saved
    assert webhook_names(saved) == ["gpu.gatekeeper.dev", "gpu" + NOOP_SUFFIX]
    with pytest.raises(ScenarioError, match="called by URL"):
        noop_configs([{"metadata": {"name": "x"}, "webhooks": [{"name": "a", "clientConfig": {"service": {}}}]}],
                     "https://127.0.0.1:1")


def test_admission_compares_gatekeeper_with_the_floor_of_a_webhook_that_does_nothing() -> None:
    from loadtest.scenarios.admission import added_ms, ratios

    def run(arm: str, round_: int, pod: float, gpu: float) -> dict[str, object]:
        rows = {n: {"Average Response Time": str(v)}
                for n, v in (("CREATE pod", pod), ("CREATE gpu pod", gpu), ("CREATE secret", pod))}
        return {"arm": arm, "round": round_, "rows": rows, "phase": "rate"}

    results = [run("webhooks-off", 1, 8, 8), run("webhooks-noop", 1, 8, 9), run("webhooks-on", 1, 8, 10.8)]
    assert ratios(results, "rate", "webhooks-noop")["CREATE gpu pod"] == pytest.approx([1.125])
    assert ratios(results, "rate", "webhooks-on", "webhooks-noop")["CREATE gpu pod"] == pytest.approx([1.2])
    assert added_ms(results, "rate", "webhooks-on", "webhooks-noop")["CREATE gpu pod"] == pytest.approx([1.8])
