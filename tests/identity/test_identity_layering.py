"""The pure halves stay pure: they can move into a core package that imports no asyncio and does no I/O."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PURE = [
    "gatekeeper.proxy.identity.jwt",
    "gatekeeper.proxy.identity.cache",
    "gatekeeper.proxy.identity.classify",
    "gatekeeper.proxy.identity.review",
    "gatekeeper.proxy.identity.settings",
    "gatekeeper.proxy.flowcontrol.borrowing",
    "gatekeeper.proxy.flowcontrol.listcost",
    "gatekeeper.proxy.flowcontrol.controller",
    "gatekeeper.proxy.flowcontrol.queueset",
    "gatekeeper.proxy.flowcontrol.seats",
]
IO = {"asyncio", "aiohttp", "socket", "ssl", "httpx", "urllib.request", "gatekeeper.proxy.identity.fetch"}


def _imports(module: str) -> set[str]:
    path = Path(importlib.import_module(module).__file__ or "")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_io(module: str) -> None:
    bad = {m for m in _imports(module) if m in IO or m.split(".")[0] in {"asyncio", "aiohttp"}}
    assert not bad, f"{module} imports {sorted(bad)}"
