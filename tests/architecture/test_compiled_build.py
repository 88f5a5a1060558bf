"""The build says which of its hot modules load compiled (mypyc), and says it truthfully."""

from __future__ import annotations

import importlib
import importlib.machinery
import subprocess
import sys
from pathlib import Path

from prometheus_client import REGISTRY

from gatekeeper.runtime import compiled, metrics

REPO = Path(__file__).resolve().parents[2]


def test_every_compiled_module_is_a_source_file_of_the_package() -> None:
    for name in compiled.MODULES:
        assert (REPO / Path(*name.split("."))).with_suffix(".py").is_file(), name


def test_the_count_is_what_imports_load() -> None:
    """A module counted compiled imports from its extension, and one counted pure from its ``.py``."""
    counted = set(compiled.compiled_modules())
    for name in compiled.MODULES:
        origin = importlib.import_module(name).__file__ or ""
        assert origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) == (name in counted), (name, origin)
    assert compiled.summary() == f"{len(counted)}/{len(compiled.MODULES)}"


def test_version_and_build_info_name_the_build() -> None:
    out = subprocess.run([sys.executable, "-m", "gatekeeper", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and f"(compiled modules: {compiled.summary()})" in out.stdout, out
    metrics.build_info()
    assert REGISTRY.get_sample_value("gatekeeper_build_info", {"version": metrics.__version__,
                                                                "compiled": compiled.summary()}) == 1
