"""AdmissionReview v1 parsing, response building and JSON Patch helpers."""

from __future__ import annotations

import base64

import jsonpatch
import orjson
import pytest
from review_fixtures import review, secret

from gatekeeper.kube.admission import (
    Decision,
    ReviewError,
    add_map_entry,
    append_list_items,
    escape,
    parse_review,
    pointer,
    response,
)


def body(doc) -> bytes:  # type: ignore[no-untyped-def]
    return orjson.dumps(doc)


def test_valid_review_parses_with_uid_and_dry_run() -> None:
    doc = review(secret(), dry_run=True)
    req = parse_review(body(doc))
    assert req.uid == doc["request"]["uid"] and req.dry_run
    assert req.kind == "Secret" and req.namespace == "team-a"


@pytest.mark.parametrize(("raw", "needle"), [
    (b"", "empty request body"),
    (b"{not json", "not valid JSON"),
    (b"[]", "expected an AdmissionReview JSON object"),
    (b'{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{}}', "v1beta1"),
    (b'{"apiVersion":"admission.k8s.io/v1","kind":"Pod"}', "kind must be 'AdmissionReview'"),
    (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}', "request is missing"),
])
def test_malformed_reviews_raise_clear_errors(raw: bytes, needle: str) -> None:
    with pytest.raises(ReviewError, match=needle):
        parse_review(raw)


def test_missing_uid_and_bad_operation_and_missing_object_are_reported() -> None:
    doc = review(secret())
    del doc["request"]["uid"]
    with pytest.raises(ReviewError, match=r"request\.uid is missing"):
        parse_review(body(doc))
    doc = review(secret(), operation="PATCH")
    with pytest.raises(ReviewError, match="operation must be one of"):
        parse_review(body(doc))
    doc = review(None, kind="Secret")
    with pytest.raises(ReviewError, match="object is required for CREATE"):
        parse_review(body(doc))


def test_response_copies_uid_and_encodes_patch_as_base64_json_patch() -> None:
    d = Decision(patch=[{"op": "add", "path": "/a", "value": 1}], warnings=["x" * 200], audit={"k": "v"})
    r = response("abc", d)
    assert r["apiVersion"] == "admission.k8s.io/v1" and r["kind"] == "AdmissionReview"
    resp = r["response"]
    assert resp["uid"] == "abc" and resp["allowed"] and resp["patchType"] == "JSONPatch"
    assert orjson.loads(base64.b64decode(resp["patch"])) == [{"op": "add", "path": "/a", "value": 1}]
    assert len(resp["warnings"][0]) == 120 and resp["auditAnnotations"] == {"k": "v"}


def test_denial_carries_status_and_no_patch() -> None:
    r = response("u", Decision(allowed=False, message="no", patch=[{"op": "remove", "path": "/a"}]))
    status = r["response"]["status"]
    assert status == {"code": 403, "reason": "Forbidden", "message": "no", "status": "Failure"}
    assert "patch" not in r["response"]


def test_rfc6901_escaping_round_trips_through_jsonpatch() -> None:
    assert escape("a/b~c") == "a~1b~0c"
    assert escape("~1") == "~01"
    doc: dict = {"m": {"nvidia.com/gpu": 1, "x~/y": 2}}
    ops = [{"op": "remove", "path": pointer("m", "nvidia.com/gpu")},
           {"op": "replace", "path": pointer("m", "x~/y"), "value": 3}]
    assert jsonpatch.apply_patch(doc, ops) == {"m": {"x~/y": 3}}


def test_add_helpers_create_missing_containers() -> None:
    doc: dict = {"metadata": {}, "spec": {}}
    ops = [add_map_entry(None, "/metadata/annotations", "gatekeeper.dev/x", "1"),
           *append_list_items(None, "/spec/items", [1, 2])]
    out = jsonpatch.apply_patch(doc, ops)
    ops2 = [add_map_entry(out["metadata"]["annotations"], "/metadata/annotations", "b/c", "2"),
            *append_list_items(out["spec"]["items"], "/spec/items", [3])]
    out = jsonpatch.apply_patch(out, ops2)
    assert out["metadata"] == {"annotations": {"gatekeeper.dev/x": "1", "b/c": "2"}}
    assert out["spec"] == {"items": [1, 2, 3]}
