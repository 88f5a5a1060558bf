"""A key a release removed fails with what to do instead, not a bare "unknown key", and never silently."""

from __future__ import annotations

from pathlib import Path

import pytest

import gatekeeper.proxy.settings  # noqa: F401 - registers the proxy: section
from gatekeeper.base.config import REMOVED_KEYS, ConfigError, load_config

BASE = {"backends": "[{url: 'https://127.0.0.1:6443'}]", "upstream": "{caFile: /etc/hostname}"}


def proxy_yaml(path: Path, key: str, value: str) -> Path:
    """A proxy section with the dotted ``key`` (under ``proxy.``) set to ``value``, nested as YAML."""
    parts = key.split(".")[1:]
    lines = ["proxy:", f"  backends: {BASE['backends']}"]
    nested: dict[str, str] = {}
    if parts[0] == "upstream":
        nested["upstream"] = f"    caFile: /etc/hostname\n    {parts[1]}: {value}"
    else:
        lines.append(f"  upstream: {BASE['upstream']}")
    if len(parts) == 1:
        lines.append(f"  {parts[0]}: {value}")
    elif parts[0] != "upstream":
        nested[parts[0]] = f"    {parts[1]}: {value}"
    for section, body in nested.items():
        lines += [f"  {section}:", body]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("key", sorted(k for k in REMOVED_KEYS if k.startswith("proxy.")))
def test_a_removed_proxy_key_says_what_to_do_instead(tmp_path: Path, key: str) -> None:
    path = proxy_yaml(tmp_path / "proxy.yaml", key, "true")
    with pytest.raises(ConfigError) as err:
        load_config(path, need="proxy")
    text = str(err.value)
    assert key in text and "removed" in text and REMOVED_KEYS[key] in text, text
    assert "unknown key" not in text


def test_the_same_file_without_the_removed_key_loads(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(f"proxy:\n  backends: {BASE['backends']}\n  upstream: {BASE['upstream']}\n")
    assert load_config(path, need="proxy").proxy.backends[0].url == "https://127.0.0.1:6443"


def test_a_misspelt_key_is_still_unknown_not_removed(tmp_path: Path) -> None:
    path = proxy_yaml(tmp_path / "proxy.yaml", "proxy.connectionBalancer", "kernel")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(path, need="proxy")
