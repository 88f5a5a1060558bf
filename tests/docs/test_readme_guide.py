"""The README stays a short guide: its two fresh-machine commands where `.ci/run` reads them, its links into
docs/ resolving to pages and anchors that exist (the strict MkDocs build checks the links inside docs/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 300


def command_after(marker: str, text: str) -> str:
    """The line `.ci/run` takes: two lines below the marker (the marker, the opening fence, the command)."""
    lines = text.splitlines()
    i = lines.index(marker)
    assert lines[i + 1] == "```" and lines[i + 3] == "```", f"{marker} must be followed by a one-line fenced block"
    return lines[i + 2]


def anchors(markdown: str) -> set[str]:
    """Heading slugs as MkDocs' toc and GitHub make them, for the README's links into docs/."""
    found = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
        found.add(re.sub(r"[-\s]+", "-", slug))
    return found


def broken_links(text: str) -> list[str]:
    broken = []
    for link in re.findall(r"\]\((docs/[^)\s]+)\)", text):
        path, _, fragment = link.partition("#")
        page = REPO / path
        if not page.is_file() or (fragment and fragment not in anchors(page.read_text())):
            broken.append(link)
    return broken


def test_readme_is_a_short_guide() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES
    commands = {command_after(m, README.read_text()) for m in ("<!-- main-command -->", "<!-- test-command -->")}
    # Only the two commands may run long: .ci/run reads each from a single line.
    assert [line for line in lines if len(line) > 200 and line not in commands] == []


def test_ci_reads_the_test_command_that_builds_the_docs_strictly() -> None:
    text = README.read_text()
    command = command_after("<!-- test-command -->", text)
    ci = subprocess.run(["awk", "/<!-- test-command -->/{getline; getline; print; exit}", str(README)],
                        capture_output=True, text=True, check=True).stdout.strip()
    assert ci == command
    assert "mkdocs build --strict" in command and "pytest" in command
    assert command_after("<!-- main-command -->", text).endswith("--with-webhook --with-proxy")


def test_readme_links_into_docs_resolve() -> None:
    text = README.read_text()
    assert len(re.findall(r"\]\(docs/", text)) >= 10
    assert broken_links(text) == []


def test_link_check_sees_a_missing_page_and_anchor() -> None:
    text = "[a](docs/index.md) [b](docs/no-such-page.md) [c](docs/configuration.md#no-such-anchor)"
    assert broken_links(text) == ["docs/no-such-page.md", "docs/configuration.md#no-such-anchor"]
