"""Every configuration key, metric and ``gatekeeper`` command-line flag the documentation names exists in the code.

A page that names a key the loader refuses, a metric nothing exports or a flag the CLI rejects sends a reader to
an error; these read the pages (docs/ and the README) the way a reader does: code spans and code blocks.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gatekeeper.base.config import REMOVED_KEYS
from gatekeeper.cli import build_parser
from gatekeeper.sandbox import reference

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md"])
METRIC = re.compile(r"\bgatekeeper_[a-z0-9_]+")
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")
KEY = re.compile(r"^[a-z][A-Za-z0-9]*(?:\.(?:[a-z][A-Za-z0-9]*|\{[A-Za-z0-9,]+\}))+$")
NOT_KEYS = re.compile(r"\.(?:ya?ml|md|py|json|crt|key|conf|kubeconfig|txt|sh|com|io|dev|org|svc|local)$")
"""File names and DNS names look like dotted keys (``config.yaml``, ``gpu.nvidia.com``): not checked."""


def spans(text: str) -> Iterator[str]:
    """Inline code spans, and each line of the fenced code blocks."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    yield from (line.strip() for block in blocks for line in block.splitlines())
    yield from re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def code_metrics() -> set[str]:
    names = set()
    for path in (REPO / "gatekeeper").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC.fullmatch(node.value):
                names.add(node.value)
    return names


def expand(span: str) -> list[str]:
    """``a.{b,c}.d`` -> ``a.b.d``, ``a.c.d``."""
    m = re.search(r"\{([^}]*)\}", span)
    if not m:
        return [span]
    return [x for alt in m.group(1).split(",") for x in expand(span[:m.start()] + alt + span[m.end():])]


def known_keys() -> tuple[set[str], set[str]]:
    """(settings paths with every suffix a page may use, chart values paths). Removed keys count: pages name
    them to say what to do instead."""
    full = {k.path.replace("[]", "") for k in reference.all_keys()} | {
        p.replace("[]", "") for p in reference.section_paths()} | set(REMOVED_KEYS)
    suffixes = {".".join(p.split(".")[i:]) for p in full for i in range(len(p.split(".")))}
    values = {p for p, _, _ in reference.values_keys(reference.VALUES.read_text())}
    return suffixes, values


def roots() -> set[str]:
    _, values = known_keys()
    sections = {p.rsplit(".", 1)[-1] for p in reference.section_paths()}
    return {"proxy", "webhook"} | {s.replace("[]", "") for s in sections} | {v.split(".")[0] for v in values}


def test_every_metric_the_docs_name_is_exported() -> None:
    exported = code_metrics()
    assert "gatekeeper_fleet_endpoints_writer" in exported and "gatekeeper_proxy_requests" in exported
    unknown = set()
    for page in PAGES:
        for name in METRIC.findall(page.read_text()):
            if name.endswith("_"):  # `gatekeeper_identity_*`: a family
                ok = any(m.startswith(name) for m in exported)
            else:
                ok = any(name == m + s for m in exported for s in SUFFIXES)
            if not ok:
                unknown.add(f"{page.relative_to(REPO)}: {name}")
    assert sorted(unknown) == []


def test_every_configuration_key_the_docs_name_exists() -> None:
    settings, values = known_keys()
    first = roots()
    unknown = set()
    for page in PAGES:
        for span in spans(page.read_text()):
            candidate = span.split("=", 1)[0].split(":", 1)[0].strip()
            if not KEY.match(candidate) or NOT_KEYS.search(candidate) or candidate.split(".")[0] not in first:
                continue
            for key in expand(candidate):
                if key not in settings and key not in values and not any(v.startswith(key + ".") for v in values):
                    unknown.add(f"{page.relative_to(REPO)}: {key}")
    assert sorted(unknown) == []


def subcommand(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest subparser the words name, and the words left."""
    while words:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or words[0] not in actions[0].choices:
            break
        parser, words = actions[0].choices[words[0]], words[1:]
    return parser, words


def gatekeeper_commands(text: str) -> Iterator[list[str]]:
    for span in spans(text):
        for part in re.split(r"&&|\|\||;|\|", span):
            m = re.search(r"(?:^|\s|/)gatekeeper(?:\s+(.*))?$", part.strip())
            if not m or not (m.group(1) or "").strip() or "python" in part.split("gatekeeper")[0]:
                continue
            try:
                words = shlex.split(m.group(1), comments=True)
            except ValueError:
                continue
            yield words


def test_every_gatekeeper_flag_the_docs_use_exists() -> None:
    root = build_parser()
    unknown = set()
    checked = 0
    for page in PAGES:
        for words in gatekeeper_commands(page.read_text()):
            globals_ok = {o for a in root._actions for o in a.option_strings}
            parser, rest = subcommand(root, [w for w in words if w not in globals_ok])
            if parser is root:
                continue
            options = {o for a in parser._actions for o in a.option_strings}
            for word in rest:
                flag = word.split("=", 1)[0]
                if flag.startswith("--") and flag not in options and flag not in globals_ok:
                    unknown.add(f"{page.relative_to(REPO)}: gatekeeper {' '.join(words[:3])}... {flag}")
                checked += flag.startswith("--")
    assert checked > 20 and sorted(unknown) == []


def test_the_checks_catch_a_made_up_name(tmp_path: Path) -> None:
    settings, values = known_keys()
    assert "listener.address" in settings and "fleet.publishEndpoints.enabled" in settings
    assert "listener.adress" not in settings and "monitoring.proxyPodMonitor.port" in values
    words = next(gatekeeper_commands("`gatekeeper sandbox up --state-dir x --proxiez 3`"))
    parser, rest = subcommand(build_parser(), words)
    assert "--proxiez" in rest and "--proxiez" not in {o for a in parser._actions for o in a.option_strings}
    assert expand("image.{repository,tag}") == ["image.repository", "image.tag"]


@pytest.mark.parametrize("page", ["docs/install/topology-a.md", "docs/install/topology-b.md"])
def test_the_install_pages_name_the_files_they_copy(page: str) -> None:
    text = (REPO / page).read_text()
    named = set(re.findall(r"\bdeploy/[\w./+-]+\.(?:ya?ml|py)\b", text))
    assert named and [n for n in sorted(named) if not (REPO / n).is_file()] == []
    for n in named:
        if n.endswith((".yaml", ".yml")):
            list(yaml.safe_load_all((REPO / n).read_text()))
