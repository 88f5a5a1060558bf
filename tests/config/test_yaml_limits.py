"""Every YAML file gatekeeper reads (config, flow-control policy files) is bounded: a wrong file fails with
an error naming the file, instead of freezing or exhausting the process that reads it.

Each test runs with both parsers: libyaml's (used when the installed PyYAML has it, 0.2.6 or later) and the
pure-Python one (the fallback): the limits are gatekeeper's own, whichever parses."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gatekeeper.proxy.settings  # noqa: F401 - registers the proxy: section
from gatekeeper.base import yamlfiles as config
from gatekeeper.base.config import load_config
from gatekeeper.base.errors import ConfigError
from gatekeeper.base.yamlfiles import YAML_LIMITS, YamlLimits, load_yaml, load_yaml_all


@pytest.fixture(autouse=True, params=["libyaml", "pure"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "libyaml":
        if config.LIBYAML_LOADER is None:
            pytest.skip("this PyYAML has no libyaml 0.2.6+ binding")
        monkeypatch.setattr(config, "YAML_LOADER", config.LIBYAML_LOADER)
    else:
        monkeypatch.setattr(config, "YAML_LOADER", config.PURE_YAML_LOADER)
    return str(request.param)


def test_the_libyaml_parser_is_used_when_installed() -> None:
    """The CI image's PyYAML wheel bundles libyaml 0.2.6: a policy reload parses ~9x faster."""
    assert config.LIBYAML_LOADER is not None


def alias_bomb(levels: int, indent: str = "") -> str:
    """A "billion laughs" sequence: each item an anchor holding ten aliases of the one before (10**levels)."""
    lines = [f"{indent}- &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"]
    lines += [f"{indent}- &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, levels + 1)]
    return "".join(lines)


def proxy_config(listener_address: str) -> str:
    return ("proxy:\n  listener:\n    certFile: a\n    keyFile: b\n    address:" + listener_address
            + "  backends: [{url: 'https://127.0.0.1:1'}]\n")


def test_an_alias_bomb_in_the_config_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Without the check the loader itself is cheap (PyYAML shares one list per anchor), but the error for a
    list where a string belongs quoted the whole expanded value: 10**5 leaves here took seconds and an 8 MB
    message; nine levels are gigabytes."""
    path = tmp_path / "proxy.yaml"
    path.write_text(proxy_config("\n" + alias_bomb(5, "    ")))
    with pytest.raises(ConfigError) as err:
        load_config(path, need="proxy")
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "aliases expand the file by" in message and "alias bomb" in message
    assert len(message) < 400


def test_a_huge_wrong_value_is_quoted_in_a_bounded_error_message(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(proxy_config(" [" + ", ".join(["x" * 100] * 5000) + "]\n"))  # 0.5 MB, no alias
    with pytest.raises(ConfigError, match=r"proxy.listener.address: expected a string, got a list \['xxx") as err:
        load_config(path, need="proxy")
    assert len(str(err.value)) < 400


def test_a_file_over_the_size_limit_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text("# " + "x" * YAML_LIMITS.max_bytes + "\nproxy: {}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: config file is larger than {YAML_LIMITS.max_bytes} bytes"):
        load_config(path, need="proxy")


def test_a_device_that_never_ends_is_refused_at_the_size_limit() -> None:
    """In a child capped at 1 GiB of address space: a reader that reads to the end takes all the memory."""
    code = ("from gatekeeper.base.errors import ConfigError\nfrom gatekeeper.base.yamlfiles import load_yaml\n"
            "try:\n    load_yaml('/dev/zero')\nexcept ConfigError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)))
    assert out.stdout.startswith(f"/dev/zero: config file is larger than {YAML_LIMITS.max_bytes} bytes"), out.stderr


@pytest.mark.parametrize("text", [
    pytest.param("a: &a [1, *a]\n", id="sequence"),
    pytest.param("a: &a {self: *a}\n", id="mapping"),
])
def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path, text: str) -> None:
    """PyYAML builds a list that contains itself; validation, equality or a dump of it recursed until
    RecursionError, which is no ConfigError and escaped the reload's error handling."""
    path = tmp_path / "loop.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: invalid YAML at line 1: an alias refers to a node that contains"):
        load_yaml(path)


@pytest.mark.parametrize("text", [
    pytest.param("[" * 20000 + "]" * 20000 + "\n", id="flow"),
    pytest.param("- " * 20000 + "x\n", id="block-sequence"),
    pytest.param("".join(" " * i + "a:\n" for i in range(1200)) + " " * 1200 + "b: 1\n", id="block-mapping"),
    pytest.param("? " + "[" * 990 + "]" * 990 + "\n: 1\n", id="deep-key"),
])
def test_nesting_too_deep_for_the_parser_is_a_config_error(tmp_path: Path, text: str) -> None:
    """The pure-Python parser recurses (RecursionError); libyaml composes recursively in C and stops at its
    own limit of 1000 levels, from 0.2.6 on (older versions are not used: they would crash the process)."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: invalid YAML: nested too deeply"):
        load_yaml(path)


def test_the_alias_limit_counts_every_document_of_a_file(tmp_path: Path) -> None:
    """Per file, not per document: a thousand documents each just under the limit would not be bounded."""
    path = tmp_path / "flows.yaml"
    path.write_text("kind: A\n---\n" + alias_bomb(3) + "---\n" + alias_bomb(3))  # 12330 added nodes each
    docs = load_yaml_all(path, what="policy file", limits=YamlLimits(max_alias_nodes=30000))
    assert docs[0] == {"kind": "A"} and len(docs) == 3
    with pytest.raises(ConfigError, match=rf"^{path}: invalid YAML in the document at line 8: aliases expand the "
                                          "file by 24660 nodes, over the limit of 20000"):
        load_yaml_all(path, what="policy file", limits=YamlLimits(max_alias_nodes=20000))


def test_ordinary_anchors_still_load(tmp_path: Path) -> None:
    """Operators reuse a subject list or a limit block; that adds a handful of nodes, far below the limit."""
    path = tmp_path / "c.yaml"
    path.write_text("subjects: &s [{kind: Group, group: {name: tenants}}]\n"
                    "a: {subjects: *s}\nb: {subjects: *s}\nbase: &b {x: 1}\nc: {<<: *b, y: 2}\n")
    data = load_yaml(path)
    assert data["a"]["subjects"] == data["b"]["subjects"] == [{"kind": "Group", "group": {"name": "tenants"}}]
    assert data["c"] == {"x": 1, "y": 2}


def test_the_alias_check_is_linear_in_the_file_however_large_the_expansion(tmp_path: Path) -> None:
    """Sizes are summed over the node graph, each node once: 10**60 would-be nodes are refused at once.
    (A generous bound that only an expanding walk could exceed.)"""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(60))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"aliases expand the file by \d{62} nodes"):
        load_yaml(path)
    assert time.monotonic() - started < 30
