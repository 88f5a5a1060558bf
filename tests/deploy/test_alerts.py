"""The alert rules pass `promtool check rules` and their unit tests (`promtool test rules`), and every alert
links to its runbook page in docs/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from gatekeeper.sandbox import chart

HERE = Path(__file__).parent
RULES = chart.CHART / "files" / "alerts.yaml"
DOCS = chart.REPO / "docs"
# The runbook_url base in files/alerts.yaml: the docs/ folder on the repository's web view. The chart swaps it
# for monitoring.prometheusRule.runbookBaseUrl (tests/deploy/test_chart.py checks that).
DOCS_BASE = "https://github.com/gatekeeper/gatekeeper/blob/main/docs/"


def _promtool(promtool_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool_bin), *args], capture_output=True, text=True, timeout=300, cwd=HERE)


def test_rules_pass_promtool_check(promtool_bin: Path) -> None:
    out = _promtool(promtool_bin, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_alert_unit_tests_pass(promtool_bin: Path) -> None:
    out = _promtool(promtool_bin, "test", "rules", "alerts_test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def _rules() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown page offers: its headings' slugs (as MkDocs' toc and GitHub make them), explicit
    ``{#id}`` attributes and ``<a id="...">`` tags."""
    anchors = set(re.findall(r'<a id="([^"]+)"', markdown))
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.MULTILINE):
        if explicit := re.search(r"\{#([\w-]+)\}\s*$", title):
            anchors.add(explicit.group(1))
            continue
        slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", slug))
    return anchors


def test_every_alert_is_unit_tested() -> None:
    alerts = {r["alert"] for r in _rules()}
    tested = {t["alertname"] for case in yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == tested


def test_every_alert_links_to_an_existing_runbook_page_and_anchor() -> None:
    for rule in _rules():
        alert = rule["alert"]
        url = rule.get("annotations", {}).get("runbook_url", "")  # type: ignore[attr-defined]
        assert url.startswith(DOCS_BASE), f"{alert}: runbook_url {url!r} is not under {DOCS_BASE}"
        parts = urlsplit(url)
        page = DOCS / url[len(DOCS_BASE):].split("#")[0]
        assert page == DOCS / "operations" / "runbooks" / f"{alert}.md", f"{alert}: one runbook page per alert"
        assert page.is_file(), f"{alert}: no runbook page {page.relative_to(chart.REPO)}"
        assert parts.fragment in heading_anchors(page.read_text()), f"{alert}: no #{parts.fragment} in {page.name}"


def test_every_runbook_page_belongs_to_an_alert() -> None:
    alerts = {r["alert"] for r in _rules()}
    pages = {p.stem for p in (DOCS / "operations" / "runbooks").glob("*.md")}
    assert pages == alerts


def test_anchor_check_sees_a_missing_anchor() -> None:
    page = "# GatekeeperProxyBackendDown\n\n## What to check {#checks}\n\n<a id=\"extra\"></a>\n"
    assert heading_anchors(page) == {"gatekeeperproxybackenddown", "checks", "extra"}
    assert "gatekeeperproxybackendejected" not in heading_anchors(page)


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
