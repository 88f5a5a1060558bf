"""The package root shows the three products and their shared base at a glance (docs/architecture.md).

A new module belongs in the folder of what it serves; one dropped loose into ``gatekeeper/`` fails here, and so does
a new folder nobody placed. Adding either to the lists below is a decision the diff then shows."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gatekeeper"

ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py"}
"""The entry points: the package, ``python -m gatekeeper`` and the command line that wires the commands."""
PRODUCTS = {"webhook", "proxy", "sandbox"}
SHARED = {"kube", "base", "serving", "runtime", "certs"}
"""kube/: Kubernetes knowledge; base/: config and errors; serving/: the TLS server plumbing; runtime/: the process
(logs, metrics, temp dirs, build); certs/: the PKI and ``gatekeeper certs``."""
DATA_FILES = {"py.typed"}


def strays(root: Path) -> list[str]:
    """What stands in ``root`` beyond the agreed entries (caches and compiled extensions aside)."""
    found = []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name == "__pycache__" or name.endswith((".so", ".pyd")):
            continue
        if entry.is_dir():
            if name not in PRODUCTS | SHARED:
                found.append(f"{name}/: a folder in no group (PRODUCTS, SHARED)")
        elif name not in ROOT_MODULES | DATA_FILES:
            found.append(f"{name}: a loose module; it belongs in the folder of what it serves")
    return found


def test_the_root_holds_only_the_entry_points_and_the_agreed_folders() -> None:
    assert strays(PACKAGE) == []


def test_every_agreed_folder_is_a_package() -> None:
    for name in PRODUCTS | SHARED:
        assert (PACKAGE / name / "__init__.py").is_file(), name


def test_a_new_loose_module_or_folder_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "gatekeeper"
    for name in ROOT_MODULES | DATA_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    for name in PRODUCTS | SHARED:
        (root / name).mkdir()
    (root / "__pycache__").mkdir()
    assert strays(root) == []
    (root / "helpers.py").write_text("")
    (root / "misc").mkdir()
    assert strays(root) == ["helpers.py: a loose module; it belongs in the folder of what it serves",
                            "misc/: a folder in no group (PRODUCTS, SHARED)"]
