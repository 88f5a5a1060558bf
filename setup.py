"""The build's one dynamic part: the hot modules compiled with mypyc (``gatekeeper/runtime/compiled.py`` names them).

Everything else is in pyproject.toml. The compiled extensions sit beside the ``.py`` files, which stay in the wheel:
``GATEKEEPER_PURE=1``, no mypyc, a type error mypyc refuses or a failing C compiler give a pure build (a warning says
so), never a failed install or a half-compiled one. ``gatekeeper --version`` and ``gatekeeper_build_info{compiled}``
say which modules load compiled."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
MODULES: tuple[str, ...] = runpy.run_path(str(HERE / "gatekeeper" / "runtime" / "compiled.py"))["MODULES"]


def warn(message: str) -> None:
    print(f"gatekeeper setup.py: {message}; building pure Python", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that falls back to pure Python: when one extension fails, none is kept (a module whose shim was
    built but whose shared library was not would fail to import instead of loading its ``.py``)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing compiler (PlatformError, OSError)
            warn(f"compiling the mypyc extensions failed ({type(exc).__name__}: {exc})")
            self._remove_outputs()

    def _remove_outputs(self) -> None:
        extensions: list[Any] = self.extensions
        for ext in extensions:
            for path in {Path(self.get_ext_fullpath(ext.name)),
                         HERE / Path(self.get_ext_filename(ext.name))}:  # inplace (editable) and build_lib copies
                if path.is_file():
                    path.unlink()
        self.extensions: list[Any] = []


def remove_inplace() -> None:
    """Extensions an earlier ``pip install -e .`` left beside the sources would still win the import."""
    for name in MODULES:
        for path in (HERE / Path(*name.split("."))).parent.glob(name.rpartition(".")[2] + ".*.so"):
            path.unlink()
    for path in HERE.glob("gatekeeper_hot__mypyc.*.so"):
        path.unlink()


def ext_modules() -> list[Any]:
    if os.environ.get("GATEKEEPER_PURE") == "1":
        warn("GATEKEEPER_PURE=1")
        remove_inplace()
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        warn("mypyc is not installed")
        return []
    paths = [str(Path(*name.split("."))) + ".py" for name in MODULES]
    try:
        return list(mypycify(paths, opt_level="3", debug_level="0", group_name="gatekeeper_hot"))
    except BaseException as exc:  # mypycify exits (SystemExit) on a type error
        warn(f"mypyc refused the modules ({type(exc).__name__}: {exc})")
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
