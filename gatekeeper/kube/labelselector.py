"""Whether kube-apiserver can parse a ``labelSelector`` (pure; the rules of apimachinery's ``labels.Parse``).

The proxy never evaluates a label selector; it only needs to know whether the apiserver's ListOptions
decoding fails on one, because RequestInfo changes when it does: the apiserver then reads ``watch``
with ``strings.ToLower`` instead of ``EqualFold`` and drops a ``metadata.name`` fieldSelector (see
``requestinfo._list_options_decode``). The grammar, as upstream's lexer and parser accept it:

* tokens: runs of whitespace (space, tab, CR, LF) separate; ``! != ( ) , = == > <`` are operators
  (longest match); anything else up to the next operator or whitespace character is an identifier,
  except the words ``in`` and ``notin``; a NUL byte where a token starts ends the input, one inside an
  identifier ends it and is skipped (Go's lexer reads NUL for "no more input");
* ``selector = [requirement {"," requirement}]``;
* ``requirement = "!" key | key [op value | ("in"|"notin") "(" [values] ")"]``, each followed by
  ``,`` or the end; ``op`` is ``= == != > <``; an exact value may be
  empty; ``in``/``notin`` as values are plain identifiers;
* keys are label keys (optional DNS-subdomain prefix and ``/``, name of at most 63 characters),
  values label values (at most 63, alphanumeric at both ends), ``>``/``<`` values integers.
"""

from __future__ import annotations

import re

_OPERATOR_CHARS = frozenset("=!(),><")
_SPACE = frozenset(" \t\r\n")
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_INT = re.compile(r"[+-]?[0-9]+")
_END, _IDENT = "end", "ident"


def _tokens(selector: str) -> list[tuple[str, str]]:
    """(kind, text) pairs ending with the end token, lexed as upstream's Lexer reads bytes: reading past the
    end gives NUL, a NUL where a token starts ends the input, and a NUL inside a token ends that token
    (and is skipped)."""
    text = selector
    out: list[tuple[str, str]] = []
    pos = 0

    def read() -> str:
        nonlocal pos
        if pos < len(text):
            pos += 1
            return text[pos - 1]
        return "\0"

    while True:
        ch = read()
        while ch in _SPACE:
            ch = read()
        if ch == "\0":
            out.append((_END, ""))
            return out
        start = pos - 1
        if ch in _OPERATOR_CHARS:
            # longest operator (every operator character is one by itself, so this never fails)
            op = "!=" if text.startswith("!=", start) else "==" if text.startswith("==", start) else ch
            pos = start + len(op)
            if text.startswith("\0", pos):  # the operator scan reads one more byte; a NUL is not given back
                pos += 1
            out.append((op, op))
            continue
        word = [ch]
        while True:
            ch = read()
            if ch == "\0":
                break
            if ch in _OPERATOR_CHARS or ch in _SPACE:
                pos -= 1
                break
            word.append(ch)
        lit = "".join(word)
        out.append((lit if lit in ("in", "notin") else _IDENT, lit))


def go_int64(text: str) -> bool:
    """``strconv.ParseInt(text, 10, 64)`` succeeds: an optional sign, ASCII digits (leading zeros any number),
    in range. Never raises: the value is compared only once it has at most 19 significant digits, so a
    hostile 5,000-digit ``limit`` or ``>`` value never reaches ``int()``'s 4,300-digit limit (a ValueError,
    which made such a request a 502 with a traceback in the log before it reached flow control)."""
    if _INT.fullmatch(text) is None:
        return False
    negative = text[0] == "-"
    digits = (text[1:] if text[0] in "+-" else text).lstrip("0")
    if len(digits) > 19:
        return False
    value = int(digits or "0")
    return value <= 1 << 63 if negative else value < 1 << 63


def _key_ok(key: str) -> bool:
    parts = key.split("/")
    if len(parts) > 2:
        return False
    if len(parts) == 2 and not (0 < len(parts[0]) <= 253 and _SUBDOMAIN.fullmatch(parts[0])):
        return False
    name = parts[-1]
    return 0 < len(name) <= 63 and _NAME.fullmatch(name) is not None


def _value_ok(value: str) -> bool:
    return value == "" or (len(value) <= 63 and _NAME.fullmatch(value) is not None)


def valid(selector: str) -> bool:
    """True where ``labels.Parse(selector)`` returns no error."""
    toks = _tokens(selector)
    pos = 0

    def kind(context_values: bool = True) -> str:
        k = toks[pos][0]
        return _IDENT if context_values and k in ("in", "notin") else k

    while True:
        if kind() == _END:
            return True
        if kind() not in (_IDENT, "!"):
            return False
        # the key, after an optional "!"
        negated = kind() == "!"
        if negated:
            pos += 1
        if kind() != _IDENT or not _key_ok(toks[pos][1]):
            return False
        pos += 1
        if not negated and kind() not in (_END, ","):
            # ("!key" takes no operator: whatever follows it must be "," or the end)
            op = kind(context_values=False)
            pos += 1
            if op in ("in", "notin"):
                if kind() != "(":
                    return False
                pos += 1
                values: list[str] = []
                if kind() == ")":
                    values.append("")
                elif kind() in (_IDENT, ","):
                    while True:
                        k = kind()
                        if k == _IDENT:
                            values.append(toks[pos][1])
                            pos += 1
                            if kind() == ")":
                                break
                            if kind() != ",":
                                return False
                        elif k == ",":
                            pos += 1
                            if not values or kind() in (")", ","):
                                values.append("")
                            if kind() == ")":
                                break
                        else:
                            return False
                else:
                    return False
                pos += 1  # the ")"
            elif op in ("=", "==", "!=", ">", "<"):
                if kind() in (_END, ","):
                    values = [""]
                elif kind() == _IDENT:
                    values = [toks[pos][1]]
                    pos += 1
                else:
                    return False
                if op in (">", "<") and not all(go_int64(v) for v in values):
                    return False
            else:
                return False
            if not all(_value_ok(v) for v in values):
                return False
        # after a requirement: the end, or a comma before the next one
        k = kind()
        pos += 1
        if k == _END:
            return True
        if k != "," or kind() not in (_IDENT, "!"):
            return False
