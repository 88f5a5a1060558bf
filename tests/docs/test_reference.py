"""The configuration reference (docs/reference/) is what the code generates, every key is documented there, and the
example configs and the chart's webhook config agree with the settings they feed.

Regenerate with ``python -m gatekeeper.sandbox.reference`` after changing a settings dataclass or values.yaml.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gatekeeper.base.config import from_mapping
from gatekeeper.proxy.settings import ProxySettings
from gatekeeper.sandbox import reference
from gatekeeper.webhook.settings import ServerSettings, WebhookSettings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(reference.pages()))
def test_the_reference_page_is_what_the_code_generates(name: str) -> None:
    page = reference.DOCS / name
    assert page.is_file(), f"{page} is missing: run python -m gatekeeper.sandbox.reference"
    assert page.read_text() == reference.pages()[name], (
        f"{page.relative_to(REPO)} differs from the settings: run python -m gatekeeper.sandbox.reference")


def test_every_setting_and_section_says_what_it_is() -> None:
    keys = reference.all_keys()
    assert len(keys) > 150 and [k.path for k in keys if not k.doc] == []
    for root, prefix in ((ProxySettings, "proxy"), (WebhookSettings, "webhook")):
        assert [path for path, cls, _ in reference.walk(root, prefix) if not (cls.__doc__ or "").strip()] == []


def test_every_chart_value_has_a_comment_of_its_own_or_its_sections() -> None:
    rows = reference.values_keys(reference.VALUES.read_text())
    paths = [p for p, _, _ in rows]
    documented = {p for p, comment, _ in rows if comment}
    leaves = [p for p in paths if not any(q.startswith(p + ".") for q in paths)]
    parts = {p: p.split(".") for p in leaves}
    bare = [p for p in leaves if not any(".".join(parts[p][:i]) in documented for i in range(1, len(parts[p]) + 1))]
    assert bare == []
    data = yaml.safe_load(reference.VALUES.read_text())
    assert {p.split(".")[0] for p in paths} == set(data)  # the parser saw every top-level key


def key_paths(data: Any, prefix: str) -> set[str]:
    """Every key path in a YAML tree; items of a list of mappings under ``key[]``."""
    out: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            out |= {f"{prefix}.{key}", *key_paths(value, f"{prefix}.{key}")}
    elif isinstance(data, list):
        for item in data:
            out |= key_paths(item, prefix + "[]") if isinstance(item, dict) else set()
    return out


def known_paths(root: type, prefix: str) -> set[str]:
    return {k.path for _, _, keys in reference.walk(root, prefix) for k in keys} | {
        path.removesuffix("[]") for path, _, _ in reference.walk(root, prefix)}


def test_the_webhook_example_holds_every_key_and_nothing_else() -> None:
    raw = yaml.safe_load((REPO / "deploy" / "examples" / "webhook-config.yaml").read_text())["webhook"]
    from_mapping(WebhookSettings, raw, "webhook-config.yaml", "webhook")  # strict: unknown keys fail
    have = key_paths(raw, "webhook")
    missing = {k.path for _, _, keys in reference.walk(WebhookSettings, "webhook") for k in keys} - have
    assert missing == set(), "deploy/examples/webhook-config.yaml calls itself complete"
    map_entries = r"\.(namespaceModes|namespaceGpuMemory|namespaceGpuModels)\."  # map entries, not keys
    assert have - known_paths(WebhookSettings, "webhook") <= {p for p in have if re.search(map_entries, p)}


def test_the_proxy_example_loads_and_names_only_real_keys() -> None:
    raw = yaml.safe_load((REPO / "deploy" / "proxy" / "config.yaml").read_text())["proxy"]
    settings = from_mapping(ProxySettings, raw, "config.yaml", "proxy")  # its policy file is read at run time only
    assert key_paths(raw, "proxy") <= known_paths(ProxySettings, "proxy")
    assert settings.flow_control.fleet.publish_endpoints.enabled


def test_the_charts_webhook_config_keeps_the_webhooks_own_defaults() -> None:
    """What the chart sets under config.server equals the webhook's default, except where the chart says why."""
    server = yaml.safe_load(reference.VALUES.read_text())["config"]["server"]
    defaults = {reference.camel(f.name): f.default for f in dataclasses.fields(ServerSettings)
                if f.default is not dataclasses.MISSING}
    differ = {k: (v, defaults.get(k)) for k, v in server.items() if k in defaults and v != defaults[k]}
    assert differ == {"workers": (2, 1)}  # two processes per pod: values.yaml's resources comment counts them


def test_the_webhook_limits_page_shows_the_defaults() -> None:
    text = (REPO / "docs" / "webhook" / "hardening.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\d.]+) \|", text, re.MULTILINE))
    defaults = {reference.camel(f.name): f.default for f in dataclasses.fields(ServerSettings)}
    assert len(rows) >= 10
    assert {k: float(v) for k, v in rows.items()} == {k: float(defaults[k]) for k in rows}
