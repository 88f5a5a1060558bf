"""The alert rules pass `promtool check rules` and their unit tests (`promtool test rules`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from gatekeeper.sandbox import chart

HERE = Path(__file__).parent
RULES = chart.CHART / "files" / "alerts.yaml"
README = chart.REPO / "README.md"


def _promtool(promtool_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool_bin), *args], capture_output=True, text=True, timeout=300, cwd=HERE)


def test_rules_pass_promtool_check(promtool_bin: Path) -> None:
    out = _promtool(promtool_bin, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_alert_unit_tests_pass(promtool_bin: Path) -> None:
    out = _promtool(promtool_bin, "test", "rules", "alerts_test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_unit_tested_and_has_a_runbook_in_the_readme() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == tested
    readme = README.read_text()
    for alert in alerts:
        assert re.search(rf'<a id="runbook-{alert.lower()}"></a>', readme), f"no runbook for {alert} in README"


def test_rules_use_only_metric_names_the_components_export() -> None:
    names = set(re.findall(r"\b(gatekeeper_[a-z_]+)", RULES.read_text()))
    exported = "".join(p.read_text() for p in (chart.REPO / "gatekeeper").rglob("*.py"))
    for name in names:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}' in exported or f'"{name}"' in exported, f"{name} is not exported by any component"


def test_rules_match_only_label_values_the_components_use() -> None:
    """An exact label match (``reason="request-budget"``) on a value no component ever sets would never
    fire; the value must appear as a string in the code (regex matches are not checked)."""
    exported = "".join(p.read_text() for p in (chart.REPO / "gatekeeper").rglob("*.py"))
    selectors = re.findall(r"\b(gatekeeper_[a-z_]+)\{([^}]*)\}", RULES.read_text())
    assert any(name == "gatekeeper_webhook_refused_connections_total" for name, _ in selectors)
    for name, matchers in selectors:
        for label, value in re.findall(r'(\w+)="([^"]*)"', matchers):
            assert f'"{value}"' in exported, f'{name}{{{label}="{value}"}}: no component sets that value'


def test_dashboard_queries_only_exported_metrics() -> None:
    import json

    dash = json.loads((chart.CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    exported = "".join(p.read_text() for p in (chart.REPO / "gatekeeper").rglob("*.py"))
    for name in set(re.findall(r"\b(gatekeeper_[a-z_]+)", " ".join(exprs))):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}' in exported, f"dashboard queries {name}, which no component exports"
