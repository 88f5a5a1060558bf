"""The strict config loader: every mistake names the file, the key and what was expected."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

import gatekeeper.proxy.settings  # registers the proxy: section
import gatekeeper.webhook.settings  # noqa: F401 - registers the webhook: section
from gatekeeper.base import config
from gatekeeper.base.config import ConfigError, from_mapping, load_config, parse_duration


@dataclass(frozen=True)
class Inner:
    size_limit: int = 1
    mode: Literal["dra", "off"] = "off"


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)
    ratio: float | None = None

    def validate(self) -> None:
        if self.ratio is not None and self.ratio > 1:
            raise ValueError("ratio must be <= 1")


def test_camel_case_keys_fill_snake_case_fields() -> None:
    out = from_mapping(Outer, {"name": "a", "inner": {"sizeLimit": 5, "mode": "dra"}, "tags": ["x"], "ratio": 1})
    assert out == Outer(name="a", inner=Inner(size_limit=5, mode="dra"), tags=["x"], ratio=1.0)


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({}, "name", "required key is missing"),
        ({"name": "a", "bogus": 1}, "bogus", "unknown key"),
        ({"name": "a", "inner": {"sizeLimit": "big"}}, "inner.sizeLimit", "expected an integer"),
        ({"name": "a", "inner": {"sizeLimit": True}}, "inner.sizeLimit", "expected an integer"),
        ({"name": "a", "inner": {"mode": "mig"}}, "inner.mode", "one of 'dra', 'off'"),
        ({"name": "a", "tags": ["ok", 3]}, "tags[1]", "expected a string"),
        ({"name": "a", "ratio": 2}, "(top level)", "ratio must be <= 1"),
        ({"name": "a", "inner": []}, "inner", "expected a mapping"),
    ],
)
def test_mistakes_name_the_key_and_the_expectation(data: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(Outer, data, "cfg.yaml")
    assert err.value.source == "cfg.yaml"
    assert err.value.key == key
    assert fragment in str(err.value)


def test_yaml_syntax_errors_carry_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("proxy:\n  listener: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML at line \d+"):
        load_config(p)


def test_unknown_top_level_section_is_rejected(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("webhok: {}\n")
    with pytest.raises(ConfigError, match="webhok: unknown key"):
        load_config(p)


def test_missing_required_section_is_named(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("{}\n")
    with pytest.raises(ConfigError, match="proxy: required section is missing"):
        load_config(p, need="proxy")


def test_proxy_goaway_chance_above_upstream_limit_is_rejected(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(
        "proxy:\n  listener: {certFile: a, keyFile: b}\n  protocol: {goawayChance: 0.5}\n"
        "  backends: [{url: 'https://127.0.0.1:1'}]\n"
    )
    with pytest.raises(ConfigError, match=r"proxy.protocol: goawayChance must be within \[0, 0.02\]"):
        load_config(p)


@pytest.mark.parametrize(("text", "seconds"), [("15s", 15.0), ("500ms", 0.5), ("2m", 120.0), (3, 3.0)])
def test_durations_parse(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_bad_duration_says_what_form_is_expected() -> None:
    with pytest.raises(ValueError, match="'15s'"):
        parse_duration("soon")


def test_a_key_given_twice_is_an_error_with_both_lines(tmp_path: Path) -> None:
    p = tmp_path / "twice.yaml"
    p.write_text("webhook:\n  secrets:\n    hardLimit: 128Ki\n    softLimit: 32Ki\n    hardLimit: 1Mi\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(p) in str(err.value)
    assert "key 'hardLimit' appears twice (first at line 3)" in str(err.value) and "line 5" in str(err.value)


def test_repeated_keys_in_different_mappings_are_fine(tmp_path: Path) -> None:
    p = tmp_path / "ok.yaml"
    p.write_text("webhook:\n  secrets:\n    overrides:\n    - types: [a]\n      hardLimit: 1Mi\n"
                 "    - types: [b]\n      hardLimit: 2Mi\n")
    cfg = load_config(p)
    assert [o.hard_limit for o in cfg.webhook.secrets.overrides] == ["1Mi", "2Mi"]


def test_the_loader_knows_only_the_sections_components_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("proxy: {}\nextra: {name: x, inner: {sizeLimit: 3}}\n")
    monkeypatch.setattr(config, "_sections", {})
    with pytest.raises(ConfigError, match=r"extra: unknown key; expected one of: $"):
        load_config(p)
    config.register_section("proxy", lambda data, source, key: data)
    config.register_section("extra", config.dataclass_section(Outer))
    cfg = load_config(p, need="extra")
    assert cfg.extra == Outer(name="x", inner=Inner(size_limit=3)) and cfg.proxy == {}
    assert cfg.webhook is None
    p.write_text("extra: {name: x, inner: {sizeLimit: big}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert err.value.key == "extra.inner.sizeLimit"


@pytest.mark.parametrize(("protocol", "message"), [
    ("{h2BodyIdleTimeoutSeconds: 0}", "h2BodyIdleTimeoutSeconds must be a positive number of seconds, got 0"),
    ("{idleTimeoutSeconds: -1}", "idleTimeoutSeconds must be a positive number of seconds, got -1"),
    ("{maxConcurrentStreams: 0}", "maxConcurrentStreams must be at least 1, got 0"),
    ("{maxBufferedRequestBytes: 1000}", "maxBufferedRequestBytes must be at least 16384"),
    ("{h2MaxPingsPerInterval: -5}", "h2MaxPingsPerInterval must be at least 1, got -5"),
    ("{streamWindowBytes: 2147483648}", r"streamWindowBytes must be at most 2147483647"),
    ("{maxConcurrentStreams: 4294967296}", r"maxConcurrentStreams must be at most 4294967295"),
    ("{maxHeaderListBytes: 4294967296}", r"maxHeaderListBytes must be at most 4294967295"),
    ("{writeBufferLowBytes: 70000}", r"writeBufferLowBytes must be within \[0, writeBufferHighBytes \(65536\)\]"),
])
def test_proxy_protocol_limits_that_would_cut_every_client_are_rejected(tmp_path: Path, protocol: str,
                                                                         message: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(
        f"proxy:\n  listener: {{certFile: a, keyFile: b}}\n  protocol: {protocol}\n"
        "  backends: [{url: 'https://127.0.0.1:1'}]\n"
    )
    with pytest.raises(ConfigError, match=f"proxy.protocol: {message}"):
        load_config(p)


def test_a_config_file_that_is_not_utf8_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"proxy:\n  workers: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not UTF-8 text \(byte 18\)"):
        load_config(path)


@pytest.mark.parametrize(("flow_control", "message"), [
    ("{reloadTimeoutSeconds: 0}", "reloadTimeoutSeconds: must be positive"),
    ("{maxStuckReloads: 0}", "maxStuckReloads: must be at least 1"),
])
def test_policy_reload_limits_are_validated_naming_the_key(tmp_path: Path, flow_control: str, message: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("proxy:\n  listener: {certFile: a, keyFile: b}\n  backends: [{url: 'https://127.0.0.1:1'}]\n"
                 f"  flowControl: {flow_control}\n")
    with pytest.raises(ConfigError, match=f"proxy.flowControl: {message}"):
        load_config(p)
