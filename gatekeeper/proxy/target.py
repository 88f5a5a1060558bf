"""Request-target hygiene (pure): what the proxy accepts as a target, and nothing else.

Two attacks shaped this module:

* **Steering.** Appending a client's target to ``https://backend:port`` and
  re-parsing the string turns ``@127.0.0.1:PORT/x`` into userinfo plus a new
  authority, so the proxy would open a connection (with its front-proxy client
  certificate and stamped identity) to any host the client names.
* **Flow-control bypass.** ``/healthz/../api/v1/secrets`` is classified by its
  raw path (an exempt probe) while the HTTP client normalises it before
  sending, so the apiserver serves ``/api/v1/secrets`` unqueued.

The rules: origin-form only (``/...``); ``*`` only with OPTIONS (answered
locally, as Go's ``net/http`` does); no dot segments in any spelling
(``.``/``..``, ``%2e``, ``%2E%2e``...), no NUL, no byte outside visible ASCII,
no fragment. Whatever passes is forwarded byte for byte (the upstream URL is
built from parts with ``encoded=True``, never re-parsed), so the path
RequestInfo classifies is exactly the path the backend receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

Reason = Literal["target_form", "dot_segment", "nul", "bad_byte", "fragment"]


@dataclass(frozen=True)
class BadTarget:
    """Why a target was refused (``reason`` is the bounded metric label)."""

    reason: Reason
    message: str


def check(method: str, target: str) -> BadTarget | None:
    """None if ``target`` may be forwarded as is; else why not. ``OPTIONS *`` is the caller's to answer."""
    if target == "*":
        if method == "OPTIONS":
            return None
        return BadTarget("target_form", f'request target "*" is only valid with OPTIONS, not {method}')
    if not target.startswith("/"):
        shown = target[:64]
        return BadTarget("target_form",
                         f"request target {shown!r} is not a path: only origin-form targets (/...) are accepted")
    for ch in target:
        o = ord(ch)
        if o <= 0x20 or o >= 0x7F:
            if o == 0:
                return BadTarget("nul", "request target contains a NUL byte")
            return BadTarget("bad_byte", f"request target contains the byte 0x{o:02x}; percent-encode it")
    if "#" in target:
        return BadTarget("fragment", "request target contains a fragment (#); a target never carries one")
    path = target.split("?", 1)[0]
    if "%" in path:
        decoded = unquote(path, errors="surrogateescape")
        if "\0" in decoded:
            return BadTarget("nul", "request path contains an encoded NUL (%00)")
    else:
        decoded = path
    if "." in decoded:
        for segment in decoded.split("/"):
            if segment in (".", ".."):
                return BadTarget("dot_segment",
                                 f"request path contains the dot segment {segment!r} (in some encoding); "
                                 "send the normalised path")
    return None


def split(target: str) -> tuple[str, str]:
    """Raw path and raw query (without ``?``) of an accepted origin-form target, unchanged."""
    path, _, query = target.partition("?")
    return path, query
