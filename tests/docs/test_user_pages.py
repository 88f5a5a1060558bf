"""The documentation site keeps the product apart from the evidence: every page outside the "Design and evidence"
section of the MkDocs nav (install, configure, operate, reference, the features) is free of test paths, dates and
commit hashes; those live in the evidence pages, which say which test or measurement backs which claim."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
EVIDENCE_SECTION = "Design and evidence"

TEST_PATH = re.compile(r"(?<![\w/.-])tests/[\w./-]*")
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
"""Seven or more hex digits with at least one letter and one digit (a number like 6356992 is no hash)."""


class _Loader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (``!!python/name:``); the nav does not need them."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_pages(node: Any, section: str = "") -> list[tuple[str, str]]:
    """(top-level section, page) for every page of the nav."""
    out: list[tuple[str, str]] = []
    if isinstance(node, str):
        return [(section, node)]
    if isinstance(node, list):
        for item in node:
            out += nav_pages(item, section)
    elif isinstance(node, dict):
        for title, value in node.items():
            out += nav_pages(value, section or str(title))
    return out


def pages() -> list[tuple[str, str]]:
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)  # a SafeLoader
    return nav_pages(config["nav"])


def user_pages() -> list[str]:
    return sorted(page for section, page in pages() if section != EVIDENCE_SECTION)


def test_the_nav_has_every_page_once_and_an_evidence_section() -> None:
    listed = [page for _, page in pages()]
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk and len(set(listed)) == len(listed)
    assert {"design/evidence.md", "performance.md", "seeds.md"} <= {
        page for section, page in pages() if section == EVIDENCE_SECTION}


@pytest.mark.parametrize("page", user_pages())
def test_a_user_page_names_no_test_date_or_commit(page: str) -> None:
    text = (DOCS / page).read_text()
    found = {what: pattern.findall(text) for what, pattern in
             (("test paths", TEST_PATH), ("dates", DATE), ("commit hashes", COMMIT))}
    assert {k: v for k, v in found.items() if v} == {}, f"{page}: move these to docs/design/evidence.md"


def test_the_checks_find_what_they_look_for() -> None:
    text = "see tests/proxy/test_h2.py, measured 2026-12-04 at 79209ad; limit 6356992 and deploy/helm/values-tests/x"
    assert TEST_PATH.findall(text) == ["tests/proxy/test_h2.py"]
    assert DATE.findall(text) == ["2026-12-04"] and COMMIT.findall(text) == ["79209ad"]
