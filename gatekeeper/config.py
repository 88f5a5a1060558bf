"""Typed configuration loaded from one YAML file (base layer: knows no component).

The file's top-level keys are *sections* (``webhook:``, ``proxy:``). Each
component registers its own with :func:`register_section` when its settings
module is imported, so this loader never imports a component. A section is a
tree of frozen dataclasses; the loader maps camelCase YAML keys (the Kubernetes habit
operators already know) onto snake_case fields, checks every type, rejects
unknown keys, and reports problems as ``FILE: key.path: expected X, got Y`` so
an operator can fix the file without reading our code.

Section dataclasses live beside the component that owns them
(``gatekeeper.webhook.settings``, ``gatekeeper.proxy.settings``) so that each
component can evolve its settings without touching the others; this module
only holds the generic loader, the strict YAML reader and the section registry.
"""

from __future__ import annotations

import dataclasses
import os
import re
import reprlib
import stat
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, already phrased for the operator."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.message = message
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + message)


class NotRegularFile(ConfigError):
    """A file that must be a regular file is something else (a FIFO, a device, a socket, a directory)."""


def camel(name: str) -> str:
    """snake_case field name -> the camelCase key used in YAML."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _key_of(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("key", camel(f.name)))


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin in (dict, Mapping):
        args = get_args(tp)
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}" if args else "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({getattr(tp, '__name__', tp)})"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def describe(tp: Any) -> str:
    """How the loader names a type in its errors ("an integer", "a list of a string"); the reference pages too."""
    return _describe(tp)


def _typename(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 2, 4, 4, 60, 60


def _shown(value: Any) -> str:
    """A wrong value as an error message quotes it: bounded, however large the value (a list given for a
    string may be a whole subtree)."""
    return _SHOWN.repr(value)


def _convert(value: Any, tp: Any, source: str, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, source, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(source, key, f"expected {_describe(tp)}, got {_typename(value)}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(source, key, f"expected {_describe(tp)}, got {_shown(value)}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected {_describe(tp)}, got {_typename(value)}")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_convert(v, item_tp, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected {_describe(tp)}, got {_typename(value)}")
        ktp, vtp = get_args(tp) or (Any, Any)
        return {
            _convert(k, ktp, source, f"{key}.{k}"): _convert(v, vtp, source, f"{key}.{k}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_mapping(tp, value, source, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, str) and value:
            return Path(value)
    else:
        raise TypeError(f"config loader cannot handle type {tp!r} at {key}")
    raise ConfigError(source, key, f"expected {_describe(tp)}, got {_typename(value)} {_shown(value)}")


REMOVED_KEYS: dict[str, str] = {
    "proxy.connectionBalancing": "the kernel's SO_REUSEPORT worker model is gone: the parent always hands each "
                                 "connection to the worker with the fewest; delete the key",
    "proxy.listener.reusePort": "workers no longer listen themselves (the parent hands connections over); "
                                "delete the key",
    "proxy.flowControl.seatTimeoutSeconds": "requests end at proxy.protocol.requestTimeoutSeconds (60 s), which cuts "
                                            "the response and releases its seats; a LIST's seats go back when the "
                                            "apiserver is done (readAheadBytes); delete the key",
    "proxy.protocol.http2Engine": "the proxy has one client-facing HTTP/2 engine, its own codec; delete the key",
    "proxy.upstream.client": "the proxy has one HTTP/1.1 upstream client, its own (asyncio + llhttp); delete the key",
    "proxy.upstream.http2": "short GETs of verified callers always share multiplexed HTTP/2 connections to the "
                            "apiservers (a backend that answers HTTP/1.1 gets HTTP/1.1); delete the key",
}
"""Keys a release removed, by path: a config that still sets one fails with what to do instead, not with a bare
"unknown key" (and never silently: each one selected behaviour that no longer exists)."""


def from_mapping(cls: type[T], data: Any, source: str = "<config>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from a YAML mapping, strictly.

    Dataclasses may define ``validate(self) -> None`` raising ``ValueError`` for
    cross-field rules; the message is reported at this dataclass's key path.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, prefix or "(top level)", f"expected a mapping, got {_typename(data)}")
    assert dataclasses.is_dataclass(cls)
    hints = get_type_hints(cls)
    fields = {_key_of(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(fields))
    for key in unknown:
        where = f"{prefix}.{key}" if prefix else key
        if where in REMOVED_KEYS:
            raise ConfigError(source, where, f"removed: {REMOVED_KEYS[where]}")
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(source, where, f"unknown key; expected one of: {', '.join(sorted(fields))}")
    kwargs: dict[str, Any] = {}
    for k, f in fields.items():
        path = f"{prefix}.{k}" if prefix else k
        if k in data:
            kwargs[f.name] = _convert(data[k], hints[f.name], source, path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(source, path, f"required key is missing (expected {_describe(hints[f.name])})")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(source, prefix or "(top level)", str(exc)) from None
    return obj


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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|k|B)?\s*$")
_SIZE_UNITS = {None: 1, "B": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a Kubernetes-style quantity ('128Ki', '1536Mi', '2G', '200k')."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"expected a size like 131072, '128Ki', '1536Mi' or '2G', got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def parse_duration(value: str | float | int) -> float:
    """'15s', '500ms', '2m' or a bare number of seconds -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _DURATION.match(str(value).strip())
    if not m:
        raise ValueError(f"expected a duration like '15s', '500ms' or '2m', got {value!r}")
    n, unit = float(m.group(1)), m.group(2)
    return n * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


SectionParser = Callable[[Any, str, str], Any]
"""``parse(data, source, key)``: one top-level section's YAML value -> its typed settings.

It raises ConfigError naming ``source`` and a key path under ``key``; :func:`from_mapping`
does that for a dataclass tree."""

_sections: dict[str, SectionParser] = {}


def register_section(name: str, parse: SectionParser) -> None:
    """Make ``name:`` a known top-level section; the owning component calls this on import."""
    _sections[name] = parse


def dataclass_section(cls: type[Any]) -> SectionParser:
    """A section parser that is just :func:`from_mapping` of ``cls``."""

    def parse(data: Any, source: str, key: str) -> Any:
        return from_mapping(cls, data, source, key)

    return parse


class Config:
    """Root of a gatekeeper config file: each present section by name (``cfg.proxy``), absent ones None."""

    def __init__(self, sections: Mapping[str, Any]) -> None:
        self.sections = dict(sections)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "sections":
            raise AttributeError(name)
        return self.sections.get(name)


def load_config(path: Path | str, *, need: str | None = None) -> Config:
    """Load the root config; ``need`` names a section that must be present.

    Only registered sections are known (see :func:`register_section`): import the
    settings module of each component whose section the file may hold.
    """
    source = str(path)
    data = load_yaml(path)
    if data is None:
        data = {}
    known = sorted(_sections)
    if not isinstance(data, dict):
        raise ConfigError(source, "(top level)",
                          f"expected a mapping with sections {', '.join(known)}, got {_typename(data)}")
    unknown = sorted(set(map(str, data)) - set(known))
    if unknown:
        raise ConfigError(source, unknown[0], f"unknown key; expected one of: {', '.join(known)}")
    if need and need not in data:
        raise ConfigError(source, need, f"required section is missing; `gatekeeper {need}` needs a {need}: section")
    return Config({name: _sections[name](data[name], source, name) for name in known if name in data})
