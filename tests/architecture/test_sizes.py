"""Rooms a reader can hold at once (issue 45): no module in ``gatekeeper/`` over 500 lines, no function over 80.

A function's size is its body: from the first statement after its docstring to its last line, so the signature
(however many parameters it declares) and the docstring do not count. A nested function counts in its parent too.
A module or function that outgrows the limit is split by concern (one folder per concern, modules named after what
they hold), not squeezed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gatekeeper"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def module_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``node``'s body without its docstring; 0 for a function that is only a docstring."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    first = min(getattr(n, "lineno", body[0].lineno) for n in (body[0], *getattr(body[0], "decorator_list", ())))
    end = node.end_lineno or body[-1].lineno
    return end - first + 1


def functions(path: Path) -> Iterator[tuple[str, int, int]]:
    """(qualified name, line, body lines) of every function and method in ``path``."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                yield name, child.lineno, body_lines(child)
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        lines = module_lines(path)
        if lines > MAX_MODULE_LINES:
            found.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        for name, line, size in functions(path):
            if size > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{line} {name}: {size} body lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_no_module_or_function_is_oversized() -> None:
    problems = oversized(PACKAGE)
    assert not problems, "split these by concern:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(("source", "expected"), [
    ('def f(\n    a,\n    b,\n):\n    """Doc\n    more."""\n    x = 1\n    return x\n', 2),
    ("def f():\n    '''only a docstring'''\n", 0),
    ("async def f():\n    x = 1\n\n    return x\n", 3),
    ("def f():\n    @deco\n    def g():\n        pass\n    return g\n", 4),
])
def test_a_body_is_counted_without_signature_and_docstring(source: str, expected: int) -> None:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    assert body_lines(node) == expected


def test_the_checker_reports_a_long_module_and_a_long_function(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (root / "long.py").write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES + 1))
    (root / "fine.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    problems = oversized(root)
    assert any(p.startswith("pkg/big.py: 501 lines") for p in problems), problems
    assert any("pkg/long.py:1 f: 81 body lines" in p for p in problems), problems
    assert not any("fine.py" in p for p in problems), problems
