"""Which label selectors kube-apiserver parses (``labels.Parse``); the verdicts were checked against
apimachinery v0.37.2 itself, and so were 30,000 random strings over the grammar's characters."""

from __future__ import annotations

import pytest

from gatekeeper.kube.labelselector import go_int64, valid

VALID = ["", "a", "a=b", "a==b", "a!=b", "!a", "a,b", "a in (x,y)", "a notin (x)", "a in ()", "a in (,)",
         "a in (x,)", "a in (x,,y)", "a=", "a>1", "a<1", "in in (x)", "x.io/a=b", "a in (in)", "a=in",
         " a = b ", "in=b", "a=b,!c", "notin", "a\0", "!\0a", "a=b\t,\nc"]
INVALID = ["a=b=c", "!a=b", "!a in (x)", "a b", "=b", "a,", ",a", "a in x", "a in (x", "a>b", "a<-5", "a>",
           "a=(", "a/b/c", "-a", "a=-b", "A.io/a", "/a", "a in (x y)", "a!b", "a=" + "x" * 64, "a" * 64, "a b=c",
           "a\0b", "a>9223372036854775808", "\u017f", "a=\u017f", "a,,b", "(", "a notin", "a<+1"]


@pytest.mark.parametrize("selector", VALID)
def test_selectors_the_apiserver_parses(selector: str) -> None:
    assert valid(selector)


@pytest.mark.parametrize("selector", INVALID)
def test_selectors_the_apiserver_refuses(selector: str) -> None:
    assert not valid(selector)


def test_a_huge_integer_value_is_refused_without_an_exception() -> None:
    """``>``/``<`` values are checked as int64 before their length: 5,000 digits raised ValueError in int()."""
    assert not valid("a>" + "1" * 5000)
    assert not valid("a<" + "0" * 5000 + "1")  # a valid int64 for ParseInt, but no label value (over 63)
    assert valid("a<" + "0" * 62 + "1")


@pytest.mark.parametrize(("text", "ok"), [
    ("0", True), ("-0", True), ("+7", True), ("9223372036854775807", True), ("9223372036854775808", False),
    ("-9223372036854775808", True), ("-9223372036854775809", False), ("0" * 40 + "9223372036854775807", True),
    ("", False), ("+", False), ("1_0", False), (" 1", False), ("\uff11", False), ("1" * 5000, False),
])
def test_go_int64_is_strconv_parse_int(text: str, ok: bool) -> None:
    assert go_int64(text) is ok
