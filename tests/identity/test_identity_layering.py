"""The pure halves stay pure: they can move into a core package that imports no asyncio and does no I/O."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PURE = [
    "gatekeeper.proxy.pipeline.tokens.jwt",
    "gatekeeper.proxy.pipeline.tokens.cache",
    "gatekeeper.proxy.pipeline.tokens.classify",
    "gatekeeper.proxy.pipeline.tokens.review",
    "gatekeeper.proxy.pipeline.tokens.settings",
    "gatekeeper.proxy.flowcontrol.core.borrowing",
    "gatekeeper.proxy.flowcontrol.core.listcost",
    "gatekeeper.proxy.flowcontrol.core.controller",
    "gatekeeper.proxy.flowcontrol.core.queueset",
    "gatekeeper.proxy.flowcontrol.core.seats",
]
IO = {"asyncio", "aiohttp", "socket", "ssl", "httpx", "urllib.request", "gatekeeper.proxy.pipeline.tokens.fetch"}


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
