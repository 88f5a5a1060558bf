"""docs/seeds.md quotes only what the seeds say: every quote in its seeds' column is in the seed file it names.

A reviewer found the table's "seed's number" column holding figures no seed gives (a Kyverno latency, "the seeds'
GOAWAY setting"). The seeds are vendored under docs/seeds/sources/ with their original names (CI's checkout has no
other copy), and each cell of the column is a list of ``"quote"`` items, each group followed by a link to the seed
file it comes from. A quote must occur in that file verbatim (whitespace runs count as one space); a bare number
must occur there as a number ("5,000" and "5000" are the same). Any other word outside quotes is a paraphrase and
is refused. ``-`` says the seeds give nothing for that row.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "seeds.md"
SOURCES = REPO / "docs" / "seeds" / "sources"
COLUMN = "seed's number"
"""The header of the seeds' column."""

QUOTE = re.compile(r'"([^"]+)"')
LINK = re.compile(r"\[[^\]]*\]\((?:\./)?seeds/sources/([^)\s]+)\)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
FILLER = re.compile(r"[\s;,.:()\-%/]*")
"""What may stand between the quotes, numbers and links of a cell: separators, never words."""


def normalise(text: str) -> str:
    return " ".join(text.split())


def numbers(text: str) -> set[str]:
    return {m.replace(",", "") for m in NUMBER.findall(text)}


def table_column(markdown: str, header: str) -> list[str]:
    """The cells under ``header`` in the first Markdown table that has it, one per row."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        cells = _cells(line)
        if header in cells:
            at = cells.index(header)
            out = []
            for row in lines[i + 2:]:  # past the header and its |---| line
                if not row.startswith("|"):
                    break
                out.append(_cells(row)[at])
            return out
    raise AssertionError(f"no table with a {header!r} column")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []


def check_cell(cell: str, sources: dict[str, str]) -> list[str]:
    """What in one cell of the seeds' column the named seed files do not bear out (empty: all of it)."""
    if cell == "-":
        return []
    problems = []
    pieces = LINK.split(cell)  # text, file, text, file, ..., trailing text
    if len(pieces) == 1:
        return [f"names no seed file: {cell!r}"]
    if pieces[-1].strip(" ;,.()"):
        problems.append(f"text after the last seed file is not attributed: {pieces[-1]!r}")
    quoted = 0
    for text, name in zip(pieces[0::2], pieces[1::2], strict=False):
        if name not in sources:
            problems.append(f"no seed file {name}")
            continue
        source = normalise(sources[name])
        for quote in QUOTE.findall(text):
            quoted += 1
            if normalise(quote) not in source:
                problems.append(f"not in {name}: {quote!r}")
        rest = QUOTE.sub(" ", text)
        for number in sorted(numbers(rest)):
            quoted += 1
            if number not in numbers(sources[name]):
                problems.append(f"the number {number} is not in {name}")
        words = NUMBER.sub(" ", rest)
        if not FILLER.fullmatch(words):
            problems.append(f"words outside quotes (a paraphrase?): {normalise(words)!r}")
    if not quoted and not problems:
        problems.append(f"quotes nothing: {cell!r}")
    return problems


def sources_on_disk() -> dict[str, str]:
    return {p.name: p.read_text() for p in SOURCES.iterdir() if p.is_file()}


def test_every_quote_in_the_seeds_column_is_in_the_seed_file_it_names() -> None:
    sources = sources_on_disk()
    cells = table_column(PAGE.read_text(), COLUMN)
    assert len(cells) >= 6
    problems = [f"row {i}: {p}" for i, cell in enumerate(cells, 1) for p in check_cell(cell, sources)]
    assert problems == []
    assert sum(1 for c in cells if c != "-") >= 5, "most rows quote a seed"


def test_the_vendored_seeds_are_the_ones_the_page_names_and_nothing_else() -> None:
    named = set(LINK.findall(PAGE.read_text()))
    assert named == set(sources_on_disk()), "vendor exactly the seed files docs/seeds.md names"


SEED = ("- Fix: API Priority & Fairness (only allow two concurrent list calls, queue the rest)\n"
        "- 5,000 secrets of 0.2 MB")
LINKED = "([000](seeds/sources/a.txt))"


def test_the_checker_refuses_a_misquote_a_wrong_number_a_paraphrase_and_an_unnamed_file() -> None:
    sources = {"a.txt": SEED, "b.txt": "nothing about lists"}
    good = f'"only allow two   concurrent list calls, queue the rest"; 5000 {LINKED}'
    assert check_cell(good, sources) == []
    assert check_cell("-", sources) == []
    misquote = f'"only allow three concurrent list calls" {LINKED}'
    assert check_cell(misquote, sources) == ["not in a.txt: 'only allow three concurrent list calls'"]
    assert check_cell(f'"queue the rest"; 4,000 {LINKED}', sources) == ["the number 4000 is not in a.txt"]
    assert check_cell(f"about 15 min to heal {LINKED}", sources) == [
        "the number 15 is not in a.txt", "words outside quotes (a paraphrase?): 'about min to heal ('"]
    assert check_cell('"queue the rest"', sources) == ["names no seed file: '\"queue the rest\"'"]
    assert check_cell('"queue the rest" ([b](seeds/sources/b.txt))', sources) == [
        "not in b.txt: 'queue the rest'"]
    assert check_cell(f'"queue the rest" {LINKED} "heals" ', sources) == [
        "text after the last seed file is not attributed: ') \"heals\" '"]
    assert check_cell('"x" ([c](seeds/sources/c.txt))', sources) == ["no seed file c.txt"]


def test_the_column_is_read_from_the_table_by_its_header() -> None:
    page = "text\n\n| claim | seed's number | ours |\n|---|---|---|\n| a | \"q\" | 1 |\n| b | - | 2 |\n\nafter\n"
    assert table_column(page, COLUMN) == ['"q"', "-"]
