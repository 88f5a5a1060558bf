"""Request-target hygiene (pure): what the proxy accepts as a target, and nothing else.

Attacks it stops: *steering* (re-parsing ``https://backend`` + ``@127.0.0.1:PORT/x`` sends the proxy's client
certificate to any host); *flow-control bypass* (``/healthz/../api/v1/secrets`` classified as an exempt probe,
then normalised upstream); *blaming a backend* (a malformed ``%`` escape makes kube-apiserver reset the HTTP/2
stream, which ejected it for every client). So: origin-form only, ``*`` only with OPTIONS, no dot segments in
any spelling, no malformed escape, NUL, non-visible byte or fragment; what passes is forwarded byte for byte
from parts, never re-parsed, so RequestInfo classifies exactly the path the backend receives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

_BAD_CHAR = re.compile(r"[^\x21-\x7e]|#")
"""Anything but visible ASCII (controls, space, DEL, non-ASCII), or a fragment marker."""
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
"""A ``%`` not followed by two hex digits: Go's ``url.unescape`` fails on it (``EscapeError``)."""

Reason = Literal["target_form", "dot_segment", "nul", "bad_byte", "fragment", "bad_escape"]


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
    bad = _BAD_CHAR.search(target)
    if bad is not None:
        ch = bad.group()
        if ch == "\0":
            return BadTarget("nul", "request target contains a NUL byte")
        if ch == "#":
            return BadTarget("fragment", "request target contains a fragment (#); a target never carries one")
        return BadTarget("bad_byte", f"request target contains the byte 0x{ord(ch):02x}; percent-encode it")
    path = target.split("?", 1)[0]
    if "%" in path:
        bad_escape = _BAD_ESCAPE.search(path)
        if bad_escape is not None:
            shown = path[bad_escape.start():bad_escape.start() + 3]
            return BadTarget("bad_escape", f"request path contains the malformed escape {shown!r}; "
                             "percent-encode '%' itself as %25")
        decoded = unquote(path, errors="surrogateescape")
        if "\0" in decoded:
            return BadTarget("nul", "request path contains an encoded NUL (%00)")
    else:
        decoded = path
    if "/." in decoded:  # every segment follows a "/", so a dot segment needs one before it
        for segment in decoded.split("/"):
            if segment in (".", ".."):
                return BadTarget("dot_segment",
                                 f"request path contains the dot segment {segment!r} (in some encoding); "
                                 "send the normalised path")
    return None
