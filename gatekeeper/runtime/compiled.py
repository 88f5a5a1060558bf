"""The hot modules the wheel compiles with mypyc (``setup.py``), and which of them this process loads compiled.

One source stays the one implementation: mypyc compiles these typed modules to C extensions placed beside their
``.py`` files, and Python's import prefers the extension. Where no compiler ran (``GATEKEEPER_PURE=1``, no C compiler,
a source checkout) the ``.py`` is what loads. ``setup.py`` reads ``MODULES`` from this file without importing the
package, so this module imports nothing of gatekeeper. Why these modules and no others: docs/proxy/compiled.md."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os

MODULES: tuple[str, ...] = (
    "gatekeeper.proxy.h2wire.client_codec",
    "gatekeeper.proxy.h2wire.connection",
    "gatekeeper.proxy.h2wire.errors",
    "gatekeeper.proxy.h2wire.frames",
    "gatekeeper.proxy.h2wire.hpack_decode",
    "gatekeeper.proxy.h2wire.hpack_encode",
    "gatekeeper.proxy.h2wire.hpack_tables",
    "gatekeeper.proxy.h2wire.huffman",
    "gatekeeper.proxy.listen.h2_codec",
    "gatekeeper.proxy.listen.h2_headers",
    "gatekeeper.proxy.listen.h2_send",
    "gatekeeper.proxy.upstream.mux_wire",
    "gatekeeper.kube.requestinfo",
    "gatekeeper.kube.admission",
    "gatekeeper.webhook.secrets",
)
"""Compiled together (one mypyc group: calls between them are native)."""


def compiled_origins() -> dict[str, str]:
    """The ``MODULES`` that import from a C extension here, and its path (found, not imported: only their packages
    load)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = {}
    for name in MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        if spec is not None and spec.origin is not None and spec.origin.endswith(suffixes):
            found[name] = spec.origin
    return found


def compiled_modules() -> list[str]:
    return list(compiled_origins())


def stale_modules() -> list[str]:
    """Compiled modules whose ``.py`` beside the extension changed after it was built: in a checkout installed with
    ``pip install -e .``, the extension (the old code) would still be what imports."""
    stale = []
    for name, origin in compiled_origins().items():
        source = os.path.join(os.path.dirname(origin), name.rpartition(".")[2] + ".py")
        if os.path.exists(source) and os.path.getmtime(source) > os.path.getmtime(origin):
            stale.append(name)
    return stale


def summary() -> str:
    """``"15/15"``: compiled modules loaded, of those the wheel compiles (``"0/15"``: pure Python)."""
    return f"{len(compiled_modules())}/{len(MODULES)}"
