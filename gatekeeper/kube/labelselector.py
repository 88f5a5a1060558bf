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

The grammar has no nesting, so :func:`valid` is one regular expression run by ``re`` (in C) over the
whole selector, after the NUL rules (a NUL ending a token reads as a space, the first at a token start
ends the input). Every token is matched whole (a lookahead for the next delimiter), and every
repetition consumes a literal comma or a bounded run, so the match is linear in the input: a hostile
1 MiB selector costs about 0.1 s here, against about 2 s for a token-by-token Python parser (it is
parsed only when the decode matters, see ``requestinfo``). ``tests/kube/test_labelselector.py`` holds
the verdicts checked against apimachinery's own parser.
"""

from __future__ import annotations

import re

_INT = re.compile(r"[+-]?[0-9]+")


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


_WS = r"[ \t\r\n]*"
_TOKEN_END = r"(?=[=!(),<> \t\r\n]|\Z)"  # an identifier is the whole run up to a delimiter
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"  # a label name or non-empty value: at most 63
_DNS_LABEL = r"[a-z0-9]+(?:-+[a-z0-9]+)*"  # alphanumeric at both ends; written so it cannot backtrack
_KEY = rf"(?:(?=[-a-z0-9.]{{1,253}}/){_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?{_NAME}{_TOKEN_END}"
_VALUE = rf"{_NAME}{_TOKEN_END}"
_EXACT = rf"(?:==|!=|=){_WS}(?:{_VALUE}|(?=,|\Z))"  # an empty value before "," or the end
_COMPARE = rf"[<>]{_WS}[0-9]{{1,63}}{_TOKEN_END}"  # an integer that is also a label value: no sign
_SET = rf"(?:in|notin){_TOKEN_END}{_WS}\({_WS}(?:(?:{_VALUE}{_WS})?,{_WS})*+(?:{_VALUE}{_WS})?\)"
_REQUIREMENT = rf"(?:!{_WS}{_KEY}|{_KEY}(?:{_WS}(?:{_EXACT}|{_COMPARE}|{_SET}))?)"
_SELECTOR = re.compile(rf"{_WS}(?:{_REQUIREMENT}{_WS}(?:,{_WS}{_REQUIREMENT}{_WS})*+)?")
_INPUT_END = re.compile(r"(?<![^ \t\r\n\0])\0")  # a NUL at the start, after whitespace or after a NUL
_LONG_COMPARED = re.compile(r"[<>][ \t\r\n]*([0-9]{19,})")  # shorter ones are in int64 range


def valid(selector: str) -> bool:
    """True where ``labels.Parse(selector)`` returns no error."""
    if "\0" in selector:
        end = _INPUT_END.search(selector)
        if end is not None:
            selector = selector[:end.start()]
        selector = selector.replace("\0", " ")
    if _SELECTOR.fullmatch(selector) is None:
        return False
    return all(go_int64(m.group(1)) for m in _LONG_COMPARED.finditer(selector))
