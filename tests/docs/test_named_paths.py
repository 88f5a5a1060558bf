"""Every source file the repository's text names still exists.

Modules get merged and benchmarks become subcommands; a docstring, comment or page that still names the old file
sends a reader to nothing (issue 27 found four such names). Dated reports under loadtest/reports/ are history and
may name what is gone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"(?<![\w/.-])((?:gatekeeper|loadtest|tests)/[\w/]+\.py)\b")
HISTORY = "loadtest/reports/"
THIS = "tests/docs/test_named_paths.py"


def missing_names(root: Path, files: list[str]) -> list[str]:
    """``file: path`` for each ``gatekeeper/``, ``loadtest/`` or ``tests/`` .py path named in ``files`` that is
    not a file under ``root``."""
    out = []
    for name in files:
        if name.startswith(HISTORY) or not name.endswith((".py", ".md", ".yaml", ".yml", ".toml")):
            continue
        text = (root / name).read_text(errors="replace")
        out.extend(f"{name}: {path}" for path in sorted(set(NAMED.findall(text))) if not (root / path).is_file())
    return out


def test_the_repository_names_only_source_files_that_exist() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    files = [name for name in tracked.split() if name != THIS]  # its fixture names deleted paths on purpose
    assert len(files) > 100
    assert missing_names(REPO, files) == []


def test_a_name_of_a_deleted_module_is_found(tmp_path: Path) -> None:
    gone, bench = "gatekeeper/gone.py", "loadtest/bench_gone.py"
    (tmp_path / "gatekeeper").mkdir()
    (tmp_path / "gatekeeper" / "kept.py").write_text(f'"""Parsed as in {gone}; see gatekeeper/kept.py."""\n')
    (tmp_path / "loadtest" / "reports").mkdir(parents=True)
    (tmp_path / "loadtest" / "reports" / "old.md").write_text(f"measured with {bench}\n")
    (tmp_path / "README.md").write_text(f"run `python {bench}`, or see x/{gone}\n")
    files = ["gatekeeper/kept.py", "loadtest/reports/old.md", "README.md"]
    assert missing_names(tmp_path, files) == [f"gatekeeper/kept.py: {gone}", f"README.md: {bench}"]
