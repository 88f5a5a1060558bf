"""The import contract: every layer points down (design.md §4, README "Development").

    cli  ->  */command.py  ->  components (webhook, proxy, sandbox)  ->  kube/ + base

* Nothing imports ``gatekeeper.cli`` but ``gatekeeper.__main__``; command
  modules are imported only by the CLI; components import no command module.
* ``kube/`` and the base (``base/``, ``serving/``, ``runtime/``, ``certs/``) import no component; ``kube/``
  and ``runtime.metrics``/``runtime.multiproc`` do no network I/O (no asyncio, aiohttp, socket, ssl).
* ``webhook`` and ``proxy`` never import each other, and neither imports
  ``sandbox`` (the sandbox runs them, not the other way round).
* The flow-control core (objects, policy, queueset, seats, controller,
  coalesce, borrowing, listcost; ``proxy/flowcontrol/core/`` once moved)
  imports no I/O library (asyncio, sockets, files, clocks, threads, YAML),
  calls no ``open()``, and imports nothing of gatekeeper but the core itself
  and ``kube/``: in particular not the edge.
* Once the proxy is in subpackages (``proxy/listen/``): the listener imports
  none of pipeline/, upstream/, flowcontrol/; pipeline/ does not import
  listen/; upstream/ imports neither listen/ nor pipeline/ nor flowcontrol/;
  flowcontrol/ imports none of listen/, upstream/, pipeline/ (identity comes before it: what both need is in
  identity/, which imports none of listen/, pipeline/, upstream/, flowcontrol/); h2wire/ (the HTTP/2 wire
  format the listener and the multiplexed upstream share) imports none of them.
* Inside ``proxy/``, three tiers: the base modules (``PROXY_BASE``: the
  message contract, target hygiene, rejections, metrics) import no proxy
  folder and no assembly module; the folders (``PROXY_FOLDERS``) import no
  assembly module (``PROXY_ASSEMBLY``: the command, its worker supervisor,
  the composed settings); every top-level proxy module is placed in a tier.
  Settings belong to the folder that uses them, and the assembly composes them.
* No import circles anywhere in the package, whatever layer: a circle makes
  the import order, not the code, decide what works.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a
function-level import is still a dependency, and hiding a cycle in one is
exactly what this test is here to stop. The checker works on any source tree,
so the tests below also prove that it catches a deliberately wrong import.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gatekeeper"

COMPONENTS = ("webhook", "proxy", "sandbox")
COMMAND_MODULES = {
    "gatekeeper.certs.command",
    *(f"gatekeeper.{c}.command" for c in COMPONENTS),
}
CLI_MODULES = {"gatekeeper.cli", "gatekeeper.__main__"}

FLOW_CORE = ("objects", "policy", "queueset", "seats", "controller", "coalesce", "borrowing", "listcost")
FLOW_EDGE = ("middleware", "fanout", "loading", "metrics", "defaults", "ledger")
IO_LIBRARIES = (
    "asyncio", "aiohttp", "socket", "ssl", "selectors", "subprocess", "threading", "signal", "os", "pathlib",
    "io", "shutil", "tempfile", "fcntl", "mmap", "time", "yaml", "urllib.request", "http.client",
    "prometheus_client", "logging",
)
PROXY_BASE = ("messages", "target", "rejections", "tally", "metrics", "adapter", "handoff")
"""Top-level proxy modules every folder may use: they import no folder and no assembly module. ``handoff`` is
the connection hand-off protocol both sides speak: the supervisor sends, the listener's Inbox receives."""
PROXY_FOLDERS = ("listen", "identity", "pipeline", "upstream", "flowcontrol", "h2wire")
PROXY_ASSEMBLY = ("command", "process", "workers", "worker_metrics", "settings", "check", "gcpace", "memtrace",
                  "caches")
"""The proxy put together: the command, its worker supervisor and the settings composed from the folders'."""
NETWORK_LIBRARIES = ("asyncio", "aiohttp", "socket", "ssl", "selectors", "http.client", "urllib.request")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path) -> Iterator[Import]:
    """Every import in the package at ``root`` (absolute and relative, at any depth of the code)."""
    for path in sorted(root.rglob("*.py")):
        name = module_name(root, path)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(name, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                yield Import(name, base, node.lineno)
                for alias in node.names:  # `from pkg import module` depends on pkg.module
                    yield Import(name, f"{base}.{alias.name}", node.lineno)


def open_calls(root: Path, module: str) -> list[int]:
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        path = root.joinpath(*module.split(".")[1:], "__init__.py")
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "open"]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer(module: str) -> str:
    """cli, command, webhook/proxy/sandbox (components), kube or base; '' for anything outside gatekeeper."""
    if not within(module, "gatekeeper"):
        return ""
    if module in CLI_MODULES:
        return "cli"
    if module in COMMAND_MODULES:
        return "command"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in (*COMPONENTS, "kube"):
        return parts[1]
    return "base"


RANK = {"cli": 0, "command": 1, "webhook": 2, "proxy": 2, "sandbox": 2, "kube": 3, "base": 3}


def flow_part(module: str) -> str:
    """'core', 'edge' or '' for a flow-control module, in the flat layout and in core/ + edge/."""
    fc = "gatekeeper.proxy.flowcontrol"
    if not within(module, fc) or module == fc:
        return ""
    rest = module[len(fc) + 1:].split(".")
    if rest[0] in ("core", "edge"):
        return rest[0]
    if rest[0] in FLOW_CORE:
        return "core"
    if rest[0] in FLOW_EDGE:
        return "edge"
    return ""


def subpackage_rules(root: Path) -> dict[str, tuple[str, ...]]:
    """Forbidden proxy subpackages per proxy subpackage; active once the proxy has been split."""
    if not (root / "proxy" / "listen").is_dir():
        return {}
    p = "gatekeeper.proxy."
    return {
        p + "listen": (p + "pipeline", p + "upstream", p + "flowcontrol"),
        p + "pipeline": (p + "listen",),
        p + "upstream": (p + "listen", p + "pipeline", p + "flowcontrol"),
        # Identity is settled before flow control: flow control reads the caller the pipeline's front stage set,
        # and takes what it shares with identity (the Upstream protocol, header stamping) from identity/.
        p + "flowcontrol": (p + "listen", p + "upstream", p + "pipeline"),
        p + "identity": (p + "listen", p + "pipeline", p + "upstream", p + "flowcontrol"),
        # The HTTP/2 wire format both HTTP/2 sides share: it serves them, never the other way round.
        p + "h2wire": (p + "listen", p + "pipeline", p + "upstream", p + "flowcontrol"),
    }


def proxy_tier(module: str) -> str:
    """'base', 'folder' or 'assembly' for a module under gatekeeper.proxy; 'unplaced' for an unknown
    top-level one; '' outside the proxy (and for the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["gatekeeper", "proxy"] or len(parts) < 3:
        return ""
    top = parts[2]
    if top in PROXY_FOLDERS:
        return "folder"
    if top in PROXY_BASE:
        return "base"
    if top in PROXY_ASSEMBLY:
        return "assembly"
    return "unplaced"


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import name`` counts pkg, and pkg.name if a module)."""
    internal = {module_name(root, p) for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in internal}
    for imp in imports_of(root):
        if imp.target in internal and imp.target != imp.importer:
            edges[imp.importer].add(imp.target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def violations(root: Path) -> list[str]:
    """Every broken rule in the package at ``root``, as ``importer:line imports target: rule``."""
    found: list[str] = []
    internal = {module_name(root, p) for p in root.rglob("*.py")}
    sub_rules = subpackage_rules(root)

    def bad(imp: Import, rule: str) -> None:
        found.append(f"{imp.importer}:{imp.line} imports {imp.target}: {rule}")

    seen: set[tuple[str, str]] = set()
    for imp in imports_of(root):
        src, dst = imp.importer, imp.target
        if (src, dst) in seen:
            continue
        seen.add((src, dst))
        s, d = layer(src), layer(dst)
        if d and dst not in internal and not within(dst, "gatekeeper.__version__"):
            # `from gatekeeper.x import name`: the module is the dependency, its names are not modules
            if dst.rpartition(".")[0] in internal:
                continue
        if d == "cli" and src != "gatekeeper.__main__":
            bad(imp, "only gatekeeper.__main__ imports the CLI (errors live in gatekeeper.base.errors)")
        elif d == "command" and s not in ("cli", "command"):
            bad(imp, "command modules are wired by the CLI; a component must not import one")
        elif d and s and d != s and RANK[d] < RANK[s]:
            bad(imp, f"{s} is below {d}: layers point down (cli -> commands -> components -> kube + base)")
        elif {s, d} == {"webhook", "proxy"}:
            bad(imp, "webhook and proxy never import each other")
        elif s in ("webhook", "proxy") and d == "sandbox":
            bad(imp, "the sandbox runs the components, not the other way round")
        metrics_base = src in ("gatekeeper.runtime.metrics", "gatekeeper.runtime.multiproc")
        if (s == "kube" or metrics_base) and any(within(dst, lib) for lib in NETWORK_LIBRARIES):
            bad(imp, "kube/ and the base metrics modules do no network I/O")
        if flow_part(src) == "core":
            if any(within(dst, lib) for lib in IO_LIBRARIES):
                bad(imp, "the flow-control core is pure: no asyncio, sockets, files, clocks or threads")
            elif d and not (flow_part(dst) == "core" or d == "kube" or dst == "gatekeeper"
                            or dst == "gatekeeper.proxy.flowcontrol"):
                bad(imp, "the flow-control core imports only itself and kube/ (not the edge, not the proxy)")
        st, dt = proxy_tier(src), proxy_tier(dst)
        if st and dt and src.split(".")[2] != dst.split(".")[2]:
            if st == "base" and dt in ("folder", "assembly"):
                bad(imp, "a proxy base module imports no proxy folder and no assembly module")
            elif st == "folder" and dt == "assembly":
                bad(imp, "a proxy folder imports no assembly module (settings belong to the folder that uses them)")
        for pkg, forbidden in sub_rules.items():
            if within(src, pkg):
                for other in forbidden:
                    if within(dst, other):
                        bad(imp, f"{pkg} must not import {other} (the proxy's folders are its pipeline)")
    for module in sorted(internal):
        if proxy_tier(module) == "unplaced":
            found.append(f"{module}: a top-level proxy module in no tier (PROXY_BASE, PROXY_FOLDERS, PROXY_ASSEMBLY)")
    for circle in circles(graph(root)):
        found.append("import circle: " + " -> ".join(circle))
    for module in sorted(internal):
        if flow_part(module) == "core":
            for line in open_calls(root, module):
                found.append(f"{module}:{line} calls open(): the flow-control core does no file I/O")
    return found


def test_gatekeeper_keeps_its_layers() -> None:
    problems = violations(PACKAGE)
    assert not problems, "import contract broken:\n  " + "\n  ".join(problems)


def test_the_checker_sees_every_package_module() -> None:
    names = {module_name(PACKAGE, p) for p in PACKAGE.rglob("*.py")}
    assert {"gatekeeper.cli", "gatekeeper.base.errors", "gatekeeper.base.config"} <= names
    assert any(flow_part(n) == "core" for n in names) and any(flow_part(n) == "edge" for n in names)
    assert sum(1 for i in imports_of(PACKAGE) if i.importer == "gatekeeper.cli") >= 4


# ---- the checker fails on deliberately wrong imports (synthetic trees) ------------------------------

def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "gatekeeper"
    for rel, text in {"__init__.py": "", "errors.py": "", "cli.py": "", "runtime/metrics.py": "",
                      "kube/__init__.py": "", "proxy/__init__.py": "", "webhook/__init__.py": "",
                      "sandbox/__init__.py": "", "proxy/flowcontrol/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


BAD = [
    ({"sandbox/state.py": "from gatekeeper.cli import UsageError\n"}, "only gatekeeper.__main__ imports the CLI"),
    ({"proxy/settings.py": "def f():\n    from gatekeeper import cli\n"}, "only gatekeeper.__main__ imports the CLI"),
    ({"proxy/command.py": "", "proxy/x.py": "from gatekeeper.proxy.command import run\n"},
     "a component must not import one"),
    ({"config.py": "from gatekeeper.webhook import settings\n", "webhook/settings.py": ""},
     "base is below webhook"),
    ({"kube/objects.py": "import gatekeeper.proxy.messages\n", "proxy/messages.py": ""}, "kube is below proxy"),
    ({"webhook/app.py": "from gatekeeper.proxy import metrics\n", "proxy/metrics.py": ""},
     "webhook and proxy never import each other"),
    ({"proxy/h2.py": "from ..webhook.app import x\n", "webhook/app.py": "x = 1\n"},
     "webhook and proxy never import each other"),
    ({"proxy/x.py": "from gatekeeper.sandbox import state\n", "sandbox/state.py": ""},
     "the sandbox runs the components"),
    ({"runtime/metrics.py": "from aiohttp import web\n"}, "no network I/O"),
    ({"proxy/flowcontrol/queueset.py": "import asyncio\n"}, "the flow-control core is pure"),
    ({"proxy/flowcontrol/core/__init__.py": "", "proxy/flowcontrol/core/policy.py": "from pathlib import Path\n"},
     "the flow-control core is pure"),
    ({"proxy/flowcontrol/controller.py": "def f():\n    from . import middleware\n",
      "proxy/flowcontrol/middleware.py": ""}, "imports only itself and kube/"),
    ({"proxy/flowcontrol/seats.py": "def f(p):\n    return open(p).read()\n"}, "calls open()"),
    ({"proxy/listen/__init__.py": "", "proxy/pipeline/__init__.py": "",
      "proxy/pipeline/stages.py": "from gatekeeper.proxy.listen import h2\n", "proxy/listen/h2.py": ""},
     "gatekeeper.proxy.pipeline must not import gatekeeper.proxy.listen"),
    ({"proxy/listen/__init__.py": "", "proxy/upstream/__init__.py": "", "proxy/pipeline/__init__.py": "",
      "proxy/upstream/client.py": "from gatekeeper.proxy.pipeline import balancer\n",
      "proxy/pipeline/balancer.py": ""},
     "gatekeeper.proxy.upstream must not import gatekeeper.proxy.pipeline"),
    ({"proxy/listen/__init__.py": "", "proxy/pipeline/__init__.py": "", "proxy/pipeline/auth.py": "",
      "proxy/flowcontrol/edge/__init__.py": "",
      "proxy/flowcontrol/edge/fleet.py": "def f():\n    from gatekeeper.proxy.pipeline.auth import h\n"},
     "gatekeeper.proxy.flowcontrol must not import gatekeeper.proxy.pipeline"),
    ({"proxy/listen/__init__.py": "", "proxy/identity/__init__.py": "", "proxy/pipeline/__init__.py": "",
      "proxy/pipeline/stages.py": "",
      "proxy/identity/auth.py": "from gatekeeper.proxy.pipeline import stages\n"},
     "gatekeeper.proxy.identity must not import gatekeeper.proxy.pipeline"),
    ({"proxy/a.py": "", "proxy/b.py": ""}, "in no tier"),
    ({"proxy/messages.py": "from gatekeeper.proxy.pipeline import stages\n", "proxy/pipeline/__init__.py": "",
      "proxy/pipeline/stages.py": ""}, "a proxy base module imports no proxy folder"),
    ({"proxy/metrics.py": "from gatekeeper.proxy import settings\n", "proxy/settings.py": ""},
     "a proxy base module imports no proxy folder and no assembly module"),
    ({"proxy/upstream/__init__.py": "", "proxy/upstream/client.py": "from gatekeeper.proxy.settings import X\n",
      "proxy/settings.py": "X = 1\n"}, "a proxy folder imports no assembly module"),
    ({"kube/a.py": "from gatekeeper.kube import b\n", "kube/b.py": "from gatekeeper.kube.a import x\n"},
     "import circle: gatekeeper.kube.a -> gatekeeper.kube.b"),
    ({"proxy/upstream/__init__.py": "", "proxy/upstream/mux.py": "def f():\n    from . import mux_stream\n",
      "proxy/upstream/mux_stream.py": "from gatekeeper.proxy.upstream.mux import Mux\n"},
     "import circle: gatekeeper.proxy.upstream.mux -> gatekeeper.proxy.upstream.mux_stream"),
    ({"webhook/a.py": "import gatekeeper.webhook.b\n", "webhook/b.py": "import gatekeeper.webhook.c\n",
      "webhook/c.py": "from gatekeeper.webhook import a\n"}, "import circle: gatekeeper.webhook.a -> "),
]


@pytest.mark.parametrize(("files", "rule"), BAD, ids=[rule for _, rule in BAD])
def test_a_deliberately_wrong_import_is_reported(tmp_path: Path, files: dict[str, str], rule: str) -> None:
    problems = violations(tree(tmp_path, files))
    assert any(rule in p for p in problems), problems


def test_imports_that_point_down_pass(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "__main__.py": "from gatekeeper.cli import main\n",
        "cli.py": "from gatekeeper.proxy import command\nfrom gatekeeper.base.errors import UsageError\n",
        "proxy/command.py": "from gatekeeper.proxy.listen import server\nfrom gatekeeper import errors\n",
        "proxy/listen/__init__.py": "",
        "proxy/listen/server.py": "import asyncio\nfrom gatekeeper.proxy import messages\n",
        "proxy/messages.py": "", "proxy/pipeline/__init__.py": "",
        "proxy/pipeline/stages.py":
            "from gatekeeper.proxy.upstream import client\nfrom gatekeeper.kube import status\n",
        "proxy/upstream/__init__.py": "", "proxy/upstream/client.py": "import aiohttp\n", "kube/status.py": "",
        "proxy/flowcontrol/core/__init__.py": "", "proxy/flowcontrol/core/policy.py": "import math\n",
        "proxy/flowcontrol/core/controller.py": "from gatekeeper.proxy.flowcontrol.core.policy import x\n",
        "proxy/flowcontrol/edge/__init__.py": "",
        "proxy/flowcontrol/edge/middleware.py":
            "import asyncio\nfrom gatekeeper.proxy.flowcontrol.core import policy\n",
        "sandbox/with_proxy.py": "from gatekeeper.proxy import messages\n",
    })
    assert violations(root) == []


def test_a_chain_without_a_cycle_is_no_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
