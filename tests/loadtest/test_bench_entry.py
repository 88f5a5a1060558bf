"""``python -m loadtest bench``: every registered benchmark answers --help, and the list names them all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench import BENCHES

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadtest", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_explains_itself(name: str) -> None:
    out = bench(name, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"python -m loadtest bench {name}" in out.stdout and "--" in out.stdout, out.stdout


def test_without_a_name_the_list_names_every_benchmark_and_fails() -> None:
    out = bench()
    assert out.returncode == 2
    assert all(name in out.stdout for name in BENCHES), out.stdout


def test_an_unknown_name_is_refused_with_the_list() -> None:
    out = bench("kernel-balancing")
    assert out.returncode == 2 and "unknown benchmark 'kernel-balancing'" in out.stderr


def test_the_scenarios_still_parse_as_before() -> None:
    out = subprocess.run([sys.executable, "-m", "loadtest", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "list-storm" in out.stdout
