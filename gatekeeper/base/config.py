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
only holds the generic loader and the section registry; ``gatekeeper.base.yamlfiles`` is the strict YAML reader.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from gatekeeper.base.errors import ConfigError
from gatekeeper.base.yamlfiles import load_yaml

T = TypeVar("T")


def camel(name: str) -> str:
    """snake_case field name -> the camelCase key used in YAML."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def require(settings: object, prefix: str = "", *, positive: tuple[str, ...] = (),
            at_least_one: tuple[str, ...] = ()) -> None:
    """The ``validate()`` check most sections repeat: ValueError naming the first field (by its YAML key, after
    ``prefix``) of ``positive`` that is not above 0, or of ``at_least_one`` that is under 1."""
    for name in positive:
        if not getattr(settings, name) > 0:
            raise ValueError(f"{prefix}{camel(name)}: must be positive")
    for name in at_least_one:
        if getattr(settings, name) < 1:
            raise ValueError(f"{prefix}{camel(name)}: must be at least 1")


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



_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|k|B)?\s*$")
_SIZE_UNITS = {None: 1, "B": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@functools.lru_cache(maxsize=256, typed=True)  # typed: True is not 1
def parse_size(value: int | str) -> int:
    """Bytes from an integer or a Kubernetes-style quantity ('128Ki', '1536Mi', '2G', '200k').

    Cached: the size policy reads its limits from the settings' strings on every review."""
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
