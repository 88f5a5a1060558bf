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
