"""The proxy serves HTTP/2 with its own codec only: no ``h2``, ``hpack`` or ``hyperframe`` import under proxy/.

Those libraries were the proxy's second HTTP/2 engine until issue 27 kept one
engine per role (``loadtest/reports/2026-12-03-h2-engine.md``); they stay in the
tests as a differential oracle (``tests/proxy/h2_oracle.py``), never as a
fallback. Every import counts, also one inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "gatekeeper" / "proxy"
HTTP2_LIBRARIES = ("h2", "hpack", "hyperframe")


def library_imports(root: Path) -> list[str]:
    """``file:line module`` for every import of one of HTTP2_LIBRARIES in the ``.py`` files under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] in HTTP2_LIBRARIES]
    return found


def test_nothing_under_proxy_imports_an_http2_library() -> None:
    assert library_imports(PROXY) == []


def test_the_check_finds_an_http2_library_imported_anywhere_in_a_module(tmp_path: Path) -> None:
    (tmp_path / "listen").mkdir()
    (tmp_path / "listen" / "codec.py").write_text("def f():\n    from hpack.table import HeaderTable\n")
    (tmp_path / "frames.py").write_text("import hyperframe.frame\nimport h2c_is_another_name\n")
    assert library_imports(tmp_path) == ["frames.py:1 hyperframe.frame", "listen/codec.py:2 hpack.table"]
