"""The strict YAML reader behind every file gatekeeper reads (base layer): the config file and the flow-control
policy files.

A key given twice is an error, a file is read within :class:`YamlLimits` (size, aliases, nesting, time), and every
problem is a :class:`~gatekeeper.base.errors.ConfigError` naming the file; :mod:`gatekeeper.base.config` maps what
it reads onto settings dataclasses.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import typing
from pathlib import Path
from typing import Any

import yaml

from gatekeeper.base.errors import ConfigError, NotRegularFile


class _StrictConstructor(yaml.constructor.SafeConstructor):
    """SafeConstructor that refuses a key given twice in one mapping (PyYAML keeps the last one silently,
    so a second ``hardLimit:`` further down a long file would quietly win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: SafeLoader merges it below, and an
                continue  # explicit key may override a merged one (constructing ``<<`` itself failed)
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) and key in seen:
                first = seen[key]
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {first.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


class _StrictLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
                    _StrictConstructor, yaml.resolver.Resolver):
    """PyYAML's pure-Python SafeLoader with the strict constructor (no arbitrary objects)."""

    def __init__(self, stream: str) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _StrictConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)


_Loader = type[_StrictLoader]


def _libyaml_loader() -> _Loader | None:
    """The strict loader over libyaml's parser (CSafeLoader's parts), or None where it is not safe to use.

    About 9x faster than the pure-Python parser (a 1 MB policy file: 1.5 s against 14 s on the loaded 2-core
    CI machine), which matters because a policy reload parses on every proxy worker. Only from libyaml 0.2.6
    on: that version limits nesting (1000 levels, "exceeded maximum nesting depth"); libyaml composes nodes
    recursively in C, so without that limit ``[[[[...`` a megabyte deep would overflow the C stack (a crash,
    not the RecursionError the pure-Python parser raises). The constructor stays the Python one either way."""
    if not getattr(yaml, "__with_libyaml__", False):
        return None
    try:  # PyYAML's optional C extension: present only when PyYAML was built against libyaml
        from yaml import _yaml as libyaml

        if tuple(libyaml.get_version()) < (0, 2, 6):
            return None
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - an unusual PyYAML build
        return None

    class _StrictCLoader(libyaml.CParser, _StrictConstructor, yaml.resolver.Resolver):
        def __init__(self, stream: str) -> None:
            libyaml.CParser.__init__(self, stream)
            _StrictConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    return typing.cast(_Loader, _StrictCLoader)


PURE_YAML_LOADER: _Loader = _StrictLoader
LIBYAML_LOADER: _Loader | None = _libyaml_loader()
YAML_LOADER: _Loader = LIBYAML_LOADER or PURE_YAML_LOADER
"""The parser :func:`load_yaml` uses (tests run the limits against both)."""


@dataclasses.dataclass(frozen=True)
class YamlLimits:
    """What one YAML file gatekeeper reads may cost: operators' files are trusted, not infallible.

    The config file and the flow-control policy files are read at start, and the policy files again at
    every SIGHUP or change by every proxy worker (on a thread beside its serving loop, which still shares the
    CPU and the GIL with it), so a wrong file (a huge dump, ``/dev/zero``, a generated file with an anchor
    loop) must fail with a message naming the file, not stall or kill the proxy. Fixed numbers rather than
    settings: the config file cannot set the limits for reading itself.
    """

    max_bytes: int = 1 << 20
    """Largest file. PyYAML's pure-Python parser needs about 2.4 s per MiB (measured on the 2-core CI
    machine; libyaml's about a ninth of that), all of it competing with the serving loop for the GIL during a
    policy reload; real files are a few KiB."""
    max_alias_nodes: int = 100_000
    """Nodes that aliases may add to one file (all its documents), each use of ``*name`` counting the whole
    subtree it names again. PyYAML shares one object per anchor, so loading stays cheap, but whatever walks the result
    (validation, an error message's ``repr``, equality, a dump) pays the expanded size: nine levels of ten
    aliases ("billion laughs", 400 bytes) are 10**9 nodes. Reusing a subject list in a few FlowSchemas
    adds hundreds."""


YAML_LIMITS = YamlLimits()


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _read_regular(p: Path, what: str, limits: YamlLimits) -> bytes:
    """At most ``limits.max_bytes`` + 1 bytes of ``p``, which must be a regular file (symlinks followed).

    Opened with O_NONBLOCK, so opening a FIFO cannot block (for want of a writer), and checked with fstat on
    the descriptor read (no window for the path to change in between). A FIFO whose writer never writes, or
    ``/dev/zero`` behind a symlink, held a policy reload's thread in ``open()`` or ``read()`` for ever."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise NotRegularFile(str(p), "", f"{what} is {kind}, not a regular file: refused (reading it could "
                                             "block or never end)")
        return f.read(limits.max_bytes + 1)


def _read_text(p: Path, what: str, limits: YamlLimits, *, regular_only: bool = False) -> str:
    """The file as UTF-8 text, reading at most one byte past the limit (a FIFO or device never ends).

    ``regular_only``: refuse anything but a regular file, before reading (see :func:`_read_regular`)."""
    try:
        if regular_only:
            data = _read_regular(p, what, limits)
        else:
            with p.open("rb") as f:
                data = f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ConfigError(str(p), "", f"cannot read {what}: {exc.strerror}") from None
    if len(data) > limits.max_bytes:
        raise ConfigError(str(p), "", f"{what} is larger than {limits.max_bytes} bytes, the limit for a YAML file "
                                      "gatekeeper reads; is it the right file?")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), "", f"not UTF-8 text (byte {exc.start}); a {what} is UTF-8 YAML") from None


def _check_aliases(node: yaml.Node, source: str, limits: YamlLimits, before: int = 0) -> int:
    """Refuse a document whose aliases, with the ``before`` nodes the file's earlier documents' aliases added,
    expand past ``limits.max_alias_nodes``, or that contains itself; returns the new total.

    Sizes are computed over the composed node graph (an alias is the very node it names), each node once,
    so the check is linear in the file however large the expansion. Iterative: a deep document must not
    hit Python's recursion limit here either.
    """
    size: dict[int, int] = {}  # node id -> nodes in its subtree, aliases expanded
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        children: list[yaml.Node] = []
        if isinstance(n, yaml.SequenceNode):
            children = list(n.value)
        elif isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        if done:
            on_path.discard(id(n))
            size[id(n)] = 1 + sum(size[id(c)] for c in children)
            continue
        if id(n) in size:
            continue
        on_path.add(id(n))
        stack.append((n, True))
        for c in children:
            if id(c) in on_path:
                raise ConfigError(source, "", f"invalid YAML at line {c.start_mark.line + 1}: an alias refers to "
                                              "a node that contains it (a loop: the value would be infinite)")
            if id(c) not in size:
                stack.append((c, False))
    added = before + size[id(node)] - len(size)
    if added > limits.max_alias_nodes:
        raise ConfigError(source, "", f"invalid YAML in the document at line {node.start_mark.line + 1}: aliases "
                                      f"expand the file by {added} nodes, over the limit of {limits.max_alias_nodes} "
                                      "(nested anchors and aliases, an alias bomb?); write the values out instead")
    return added


def _documents(text: str, source: str, limits: YamlLimits, single: bool) -> list[Any]:
    loader = YAML_LOADER(text)  # safe loading only: no arbitrary objects
    try:
        out: list[Any] = []
        added = 0  # the alias limit is per file: a thousand documents just under it would not be bounded
        if single:
            node = loader.get_single_node()
            if node is not None:
                _check_aliases(node, source, limits)
                out.append(loader.construct_document(node))
            return out
        while loader.check_node():  # one document's nodes at a time: they are ~10x the objects of its value,
            node = loader.get_node()  # and every object alive makes the reload thread's GC passes longer
            if node is not None:
                added = _check_aliases(node, source, limits, added)
                out.append(loader.construct_document(node))
        return out
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if problem == "exceeded maximum nesting depth":  # libyaml's own limit: the same words as below
            raise ConfigError(source, "", f"invalid YAML: nested too deeply{line}") from None
        raise ConfigError(source, "", f"invalid YAML{line}: {problem}") from None
    except RecursionError:  # PyYAML composes and constructs recursively: ``[[[[...`` a few thousand deep
        raise ConfigError(source, "", "invalid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml(path: Path | str, *, what: str = "config file", limits: YamlLimits = YAML_LIMITS) -> Any:
    """Read one YAML document (None if empty) within ``limits``; every problem is a ConfigError naming the file.

    The one reader for YAML files (the config, flow-control policy files, the sandbox's ``--webhook-config``):
    see :class:`YamlLimits` for why a file operators write is bounded all the same."""
    p = Path(path)
    docs = _documents(_read_text(p, what, limits), str(p), limits, single=True)
    return docs[0] if docs else None


def load_yaml_all(path: Path | str, *, what: str, limits: YamlLimits = YAML_LIMITS,
                  regular_only: bool = False) -> list[Any]:
    """Every document of a multi-document YAML file (``---``), as :func:`load_yaml` reads one.

    ``regular_only``: a path that is not a regular file is refused (:class:`NotRegularFile`) without a read."""
    p = Path(path)
    return _documents(_read_text(p, what, limits, regular_only=regular_only), str(p), limits, single=False)
