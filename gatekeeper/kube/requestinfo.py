"""Request path -> RequestInfo, the way kube-apiserver derives it.

The proxy needs the same view of a request that the apiserver's authorizer and
API Priority and Fairness get (verb, group, version, namespace, resource,
subresource, name), so that flow control classifies exactly like upstream and
metrics speak the apiserver's vocabulary. The rules follow
``k8s.io/apiserver/pkg/endpoints/request/requestinfo.go``:

* ``/api/{version}/...`` (groupless) and ``/apis/{group}/{version}/...`` are
  resource requests once they name at least a resource; anything shorter
  (``/api``, ``/api/v1``, ``/apis/apps/v1``) and every other path (``/healthz``,
  ``/openapi/v3/...``) is a non-resource request whose verb is the lower-case
  HTTP method.
* The legacy ``/watch/`` and ``/proxy/`` path prefixes set the verb directly.
* ``namespaces/{ns}/{resource}/...`` moves ``ns`` into ``namespace``; the
  namespace object itself (``/api/v1/namespaces/foo``, ``.../foo/status``,
  ``.../foo/finalize``) is resource ``namespaces`` named ``foo`` *in* namespace
  ``foo``, as upstream reports it.
* The resource verb comes from the method as sent (``get`` or ``Get`` is verb "",
  which the apiserver answers 405), the non-resource verb is the lower-cased method.
* GET without a name is ``list``, or ``watch`` when ``?watch`` is anything but
  ``false``/``0``; a ``fieldSelector`` requiring ``metadata.name=X`` narrows such
  a list/watch to name ``X`` (what informers for one object send). When the
  ListOptions do not decode (a non-integer ``limit``/``timeoutSeconds``, a
  label or field selector the apiserver cannot parse), upstream reads ``watch``
  with ``strings.ToLower`` instead and narrows nothing. DELETE without a name is
  ``deletecollection``.

The query is read the way the apiserver's Go code reads it (:func:`query_values`,
:func:`_exact_name`), not the way Python's ``parse_qs`` does: Go's
``url.ParseQuery`` silently drops every ``&``-separated pair that holds a ``;``
or a malformed ``%`` escape, and ``strings.EqualFold`` takes ``fal\u017fe`` (U+017F, long s)
for ``false``. With ``parse_qs``, ``?watch=1;`` was a watch here (seats freed
at the first bytes, no LIST byte budget) while the apiserver served a full
LIST; ``?fieldSelector=metadata.name%3Dx;`` was a one-object LIST here and the
whole collection there. The path is split without ``urlsplit``, whose
``//authority`` rule Go does not apply to a request target.

Long-running requests (their duration is not a cost signal, and flow control
must not hold seats for them) are watches, ``proxy``, and the ``attach``,
``exec``, ``portforward`` subresources, plus ``log`` when ``follow`` is set.
Upstream treats every ``log`` as long-running for its request timeout; a
non-follow log finishes on its own, so here it counts as an ordinary request.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

from gatekeeper.kube import labelselector

API_PREFIXES = frozenset({"api", "apis"})
GROUPLESS_PREFIXES = frozenset({"api"})
SPECIAL_VERBS = frozenset({"proxy", "watch"})
SPECIAL_VERBS_NO_SUBRESOURCES = frozenset({"proxy"})
NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})
LONG_RUNNING_VERBS = frozenset({"watch", "proxy"})
LONG_RUNNING_SUBRESOURCES = frozenset({"attach", "exec", "proxy", "portforward"})

_METHOD_VERBS = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}

# A DNS-1123-ish path segment; upstream only accepts a fieldSelector name that
# is a valid path segment (no "/", not "." or "..", no "%").
_BAD_SEGMENT = re.compile(r"[/%]")


@dataclass(frozen=True)
class RequestInfo:
    """What a request does, in the apiserver's words."""

    is_resource_request: bool
    """True for /api and /apis paths that name a resource."""
    path: str
    """URL path, without the query."""
    verb: str
    """Kubernetes verb (get, list, watch, create, ...); lower-case HTTP method for non-resource URLs."""
    api_prefix: str = ""
    """'api' or 'apis' for resource requests."""
    api_group: str = ""
    """API group; '' is the core group."""
    api_version: str = ""
    """API version, e.g. v1."""
    namespace: str = ""
    """Namespace; '' for cluster-scoped and all-namespace requests."""
    resource: str = ""
    """Plural resource, e.g. pods."""
    subresource: str = ""
    """Subresource, e.g. status, log, exec."""
    name: str = ""
    """Object name from the path (or an exact metadata.name fieldSelector on list/watch)."""
    parts: tuple[str, ...] = field(default=())
    """Path segments starting at the resource: resource/name/subresource/..."""
    long_running: bool = False
    """Watches, proxy, exec/attach/portforward and followed logs."""

    @property
    def resource_key(self) -> str:
        """``resource`` or ``resource/subresource`` (the form APF resourceRules and metrics use)."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def _split_path(path: str) -> list[str]:
    path = path.strip("/")
    return path.split("/") if path else []


_HEX = frozenset("0123456789abcdefABCDEF")
_FOLD = ({"f", "F"}, {"a", "A"}, {"l", "L"}, {"s", "S", "\u017f"}, {"e", "E"})
"""Every rune Go's ``strings.EqualFold`` matches to each letter of ``false`` (U+017F long s folds to s)."""


def _go_unescape(text: str) -> str | None:
    """Go's ``url.QueryUnescape``: ``+`` is a space, ``%XX`` a byte; None where Go returns an error."""
    if "%" not in text:
        return text.replace("+", " ")
    raw = text.encode("utf-8", "surrogateescape")
    out = bytearray()
    i = 0
    while i < len(raw):
        b = raw[i]
        if b == 0x25:  # %
            hexa = raw[i + 1 : i + 3].decode("latin-1")
            if len(hexa) != 2 or not set(hexa) <= _HEX:
                return None
            out.append(int(hexa, 16))
            i += 3
            continue
        out.append(0x20 if b == 0x2B else b)
        i += 1
    return out.decode("utf-8", "surrogateescape")


def query_values(query: str) -> dict[str, list[str]]:
    """A raw query string as Go's ``url.ParseQuery`` reads it (what every apiserver handler sees).

    Pairs are split on ``&`` only; a pair holding ``;`` anywhere, or a malformed ``%``
    escape in its key or value, is dropped (Go records an error and carries on,
    and ``req.URL.Query()`` ignores the error). Order and duplicates are kept.
    """
    values: dict[str, list[str]] = {}
    for pair in query.split("&"):
        if not pair or ";" in pair:
            continue
        raw_key, _, raw_value = pair.partition("=")
        key, value = _go_unescape(raw_key), _go_unescape(raw_value)
        if key is None or value is None:
            continue
        values.setdefault(key, []).append(value)
    return values


def query_flag(values: list[str] | None) -> bool:
    """apimachinery's Convert_Slice_string_To_bool: anything but ``0`` or (EqualFold) ``false`` is true."""
    if not values:
        return False
    v = values[0]
    if v == "0":
        return False
    return not (len(v) == 5 and all(c in fold for c, fold in zip(v, _FOLD, strict=True)))


_TERM = re.compile(r"(?:[^\\,]|\\.)*+(?:\\\Z)?", re.S)
"""One fieldSelector term: up to a comma no backslash escapes (a backslash escapes any character)."""


def _selector_terms(selector: str) -> list[str]:
    """fields.ParseSelector's ``splitTerms``: split on commas not escaped by a backslash.

    ``str.split`` or one regular expression match per term: a character-by-character loop cost about
    0.4 s per MiB of selector, which any caller can send (classification runs before flow control)."""
    if "\\" not in selector:
        return selector.split(",")
    terms: list[str] = []
    pos = 0
    while True:
        m = _TERM.match(selector, pos)
        assert m is not None  # the pattern matches the empty string
        terms.append(m.group())
        pos = m.end() + 1  # past the comma that ended the term
        if pos > len(selector):
            return terms


def _selector_value(raw: str) -> str | None:
    """fields.UnescapeValue: a backslash escapes only a backslash, comma or equals sign; a bare comma or
    equals sign, or a trailing backslash, is an error."""
    if "\\" not in raw:
        return None if "," in raw or "=" in raw else raw
    out: list[str] = []
    escaped = False
    for c in raw:
        if escaped:
            if c not in "\\,=":
                return None
            out.append(c)
            escaped = False
        elif c == "\\":
            escaped = True
        elif c in ",=":
            return None
        else:
            out.append(c)
    return None if escaped else "".join(out)


def _field_selector_name(selector: str) -> str | None:
    """The name an exact ``metadata.name=`` / ``==`` term requires ('' if none), or None where
    ``fields.ParseSelector`` fails.

    Mirrors ``fields.ParseSelector`` + ``RequiresExactMatch``: terms split on unescaped
    commas and sorted; each term splits at the leftmost ``!=``, ``==`` or ``=``; no
    whitespace is trimmed.
    """
    name: str | None = None
    for term in sorted(_selector_terms(selector)):
        if not term:
            continue
        # splitTerm: the leftmost of "!=", "==", "=" (each holds an "=", so it starts at or just before the
        # first one). Found with str.find: slicing the rest of the term at every index was quadratic (a
        # 200 KB term without "=" took 1.2 s of the worker's thread, a 1 MiB one half a minute).
        i = term.find("=")
        if i < 0:
            return None  # not a term: the whole selector is refused
        if i and term[i - 1] == "!":
            i, op = i - 1, "!="
        else:
            op = "==" if term.startswith("==", i) else "="
        value = _selector_value(term[i + len(op):])
        if value is None:
            return None
        if name is None and op != "!=" and term[:i] == "metadata.name":
            name = value
    return name or ""


def _exact_name(selectors: list[str] | None) -> str:
    """The name an exact ``metadata.name`` fieldSelector narrows a list/watch to, or ''.

    A selector the apiserver cannot parse narrows nothing (it answers 400). Upstream then
    keeps the name only if it is a valid path segment.
    """
    name = _field_selector_name(selectors[0]) if selectors else None
    if not name or name in (".", "..") or _BAD_SEGMENT.search(name):
        return ""
    return name


def _list_options_decode(query: dict[str, list[str]], fields_parsed: bool = False) -> bool:
    """Whether the apiserver's RequestInfo decodes the query into ListOptions without an error.

    ``DecodeParameters`` converts ``limit`` and ``timeoutSeconds`` with ``strconv.ParseInt`` (an empty
    value fails too) and parses ``labelSelector`` (``labels.Parse``) and ``fieldSelector``
    (``fields.ParseSelector``); every other ListOptions field converts without error. On an error
    upstream reads ``watch`` with ``strings.ToLower`` (so ``fal\u017fe`` is a watch there) and
    takes no name from the fieldSelector; its handler then answers 400. ``fields_parsed``: the caller
    already parsed the fieldSelector without error.
    """
    for key in ("limit", "timeoutSeconds"):
        values = query.get(key)
        if values and not labelselector.go_int64(values[0]):
            return False
    labels = query.get("labelSelector")
    if labels and not labelselector.valid(labels[0]):
        return False
    fields = query.get("fieldSelector")
    return fields_parsed or not fields or _field_selector_name(fields[0]) is not None


def _truthy_lowered(values: list[str] | None) -> bool:
    """``watch`` as upstream reads it after a ListOptions decoding error: anything but ``0`` or a value
    ``strings.ToLower`` turns into ``false`` (only ASCII letters lower into ASCII ones there)."""
    if not values:
        return False
    v = values[0]
    return not (v == "0" or (v.isascii() and v.lower() == "false"))


CACHE_ENTRIES = 4096
CACHE_MAX_TARGET = 1024
"""Targets longer than this are parsed every time (they rarely repeat, and bound the cache's memory)."""


def parse(method: str, target: str) -> RequestInfo:
    """RequestInfo for an HTTP method and raw request target (path plus optional query).

    Never raises: malformed paths come back as non-resource requests, just as
    the apiserver would then 404 them; the proxy forwards them unchanged.
    Results are memoized: the same GETs and LISTs repeat all day in a cluster,
    RequestInfo is immutable, and parsing is a pure function of its inputs.
    """
    if len(target) <= CACHE_MAX_TARGET:
        return _parse_cached(method, target)
    return _parse(method, target)


def _parse(method: str, target: str) -> RequestInfo:
    raw_path, _, raw_query = target.partition("?")
    raw_path = raw_path.partition("#")[0]
    path = unquote(raw_path) if "%" in raw_path else raw_path
    query = query_values(raw_query) if raw_query else {}
    # Upstream: a non-resource verb is the lower-cased method, but a resource verb comes from the method
    # compared case-sensitively (HTTP methods are), so ``get`` or ``Get`` is verb "" there (and a 405).
    # Upper-casing it first made ``get .../secrets`` a LIST here: a different FlowSchema than upstream's.
    non_resource = RequestInfo(is_resource_request=False, path=path, verb=method.lower())

    parts = _split_path(path)
    if len(parts) < 3 or parts[0] not in API_PREFIXES:
        return non_resource
    prefix, parts = parts[0], parts[1:]
    group = ""
    if prefix not in GROUPLESS_PREFIXES:
        if len(parts) < 3:
            return non_resource
        group, parts = parts[0], parts[1:]
    version, parts = parts[0], parts[1:]

    if parts[0] in SPECIAL_VERBS:
        if len(parts) < 2:
            # upstream returns an error with a partial info; the apiserver then 404s.
            return RequestInfo(is_resource_request=True, path=path, verb=parts[0], api_prefix=prefix,
                               api_group=group, api_version=version)
        verb, parts = parts[0], parts[1:]
    else:
        verb = _METHOD_VERBS.get(method, "")

    namespace = ""
    if parts[0] == "namespaces" and len(parts) > 1:
        namespace = parts[1]
        if len(parts) > 2 and parts[2] not in NAMESPACE_SUBRESOURCES:
            parts = parts[2:]

    resource = parts[0] if parts else ""
    name = parts[1] if len(parts) >= 2 else ""
    subresource = parts[2] if len(parts) >= 3 and verb not in SPECIAL_VERBS_NO_SUBRESOURCES else ""

    if not name and verb == "get":
        watch = query.get("watch")
        watching = query_flag(watch)
        name = _exact_name(query.get("fieldSelector"))
        # Whether the ListOptions decode matters only where its two readings differ: a metadata.name
        # fieldSelector, or a non-ASCII watch value (EqualFold and ToLower agree on ASCII). Every ordinary
        # list or watch skips it, so a label selector is never parsed on the way to a seat (a hostile
        # 1 MiB one costs seconds of the worker's one thread).
        # (a name came from a fieldSelector that parsed: not parsed twice)
        if (name or watching != _truthy_lowered(watch)) and not _list_options_decode(query, fields_parsed=bool(name)):
            watching, name = _truthy_lowered(watch), ""
        verb = "watch" if watching else "list"
    if not name and verb == "delete":
        verb = "deletecollection"

    long_running = verb in LONG_RUNNING_VERBS or subresource in LONG_RUNNING_SUBRESOURCES or (
        subresource == "log" and query_flag(query.get("follow"))
    )
    return RequestInfo(
        is_resource_request=True, path=path, verb=verb, api_prefix=prefix, api_group=group,
        api_version=version, namespace=namespace, resource=resource, subresource=subresource,
        name=name, parts=tuple(parts), long_running=long_running,
    )


_parse_cached = functools.lru_cache(maxsize=CACHE_ENTRIES)(_parse)
