"""The classification fuzz's judge accounts for every answer the apiserver gives before APF, HEAD included."""

from __future__ import annotations

import diff_fuzz as fz


def test_a_head_refused_for_its_timeout_is_the_deadline_filters_answer_though_it_has_no_body() -> None:
    """kube-apiserver's request-deadline filter answers a bad ``timeout`` with 400 before APF; to a HEAD
    without the body that says so. Judged a NO-STAMP, it failed about one run in five (the cases depend on
    the run's random namespace, so a HEAD with ``timeout=bogus`` is generated in some runs only)."""
    ours = {"x-gatekeeper-pf-flowschema": "global-default", "audit-id": "a"}
    head = fz.Case("carol", "h2", "HEAD", "/api/v1/secrets/x/status/more/parts?timeout=bogus&dryRun=All")
    assert fz.judge(head, fz.Answer(400, ours), {})[0] == "apiserver-before-apf"
    get = fz.Case("carol", "h2", "GET", "/api/v1/secrets?timeout=bogus")
    assert fz.judge(get, fz.Answer(400, ours, b'{"message":"invalid timeout specified"}'), {})[0] == (
        "apiserver-before-apf")
    # a 400 to a HEAD without a timeout parameter is still unexplained
    plain = fz.Case("carol", "h2", "HEAD", "/api/v1/secrets?limit=x")
    assert fz.judge(plain, fz.Answer(400, ours), {})[0] == "NO-STAMP"


def test_a_head_to_a_special_verb_with_nothing_after_is_requestinfos_500_though_it_has_no_body() -> None:
    """``/apis/<group>/<version>/watch`` (or ``proxy``) alone is a RequestInfo error upstream (500, before APF);
    to a HEAD without the body that says so. Found once the cases stopped depending on the run's namespace
    (``bob/h1 HEAD /apis/app+s/v1/watch?watch=1%zz``)."""
    ours = {"x-gatekeeper-pf-flowschema": "global-default", "audit-id": "a"}
    for target in ("/apis/app+s/v1/watch?watch=1%zz", "/api/v1/watch", "/api/v1/proxy/", "/apis/apps/v1/%77atch"):
        assert fz.judge(fz.Case("bob", "h1", "HEAD", target), fz.Answer(500, ours), {})[0] == (
            "apiserver-before-apf"), target
    # a 500 to a HEAD elsewhere is still unexplained
    for target in ("/api/v1/watch/pods", "/apis/apps/v1/deployments"):
        assert fz.judge(fz.Case("bob", "h1", "HEAD", target), fz.Answer(500, ours), {})[0] == "NO-STAMP", target


def test_the_cases_are_the_same_whatever_the_runs_namespace() -> None:
    a = fz.generate(7, 500, "fc-df-a1b2c3")
    b = fz.generate(7, 500, "fc-df-0f0f0f")
    assert [c.target.replace("fc-df-a1b2c3", "NS") for c in a] == [c.target.replace("fc-df-0f0f0f", "NS") for c in b]
    assert sum("fc-df-a1b2c3" in c.target for c in a) > 100
