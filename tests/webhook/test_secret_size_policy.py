"""Oversized Secret / ConfigMap policy: a table of AdmissionReview fixtures."""

from __future__ import annotations

import base64

import pytest
from review_fixtures import b64, request, review, secret

from gatekeeper.kube.admission import response
from gatekeeper.webhook import secrets
from gatekeeper.webhook.settings import SecretSettings, SizeOverride

KIB = 1024
SETTINGS = SecretSettings(hard_limit="128Ki", soft_limit="32Ki", count_annotations=True)


def decide(doc, settings: SecretSettings = SETTINGS):  # type: ignore[no-untyped-def]
    req = request(doc)
    assert secrets.handles(req, settings)
    return secrets.review(req, settings)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 1000, 131071, 131072, 131073])
def test_decoded_length_is_computed_from_base64_length(n: int) -> None:
    encoded = b64(n)
    assert secrets.b64_decoded_len(encoded) == len(base64.b64decode(encoded)) == n


def test_small_secret_is_allowed_without_warning() -> None:
    d = decide(review(secret(data={"tls.crt": b64(4 * KIB)})))
    assert d.allowed and not d.warnings and d.outcome == "allowed"


def test_seed_sized_secret_is_denied_with_actionable_message() -> None:
    d = decide(review(secret(data={"bundle": b64(212 * KIB)})))
    assert not d.allowed
    assert d.message == ("secret team-a/model-certs is 212 KiB, over the 128 KiB limit: "
                         "keep large payloads in a volume or an external secret store")
    body = response("uid-1", d)["response"]
    assert body["allowed"] is False and body["status"]["code"] == 403 and "patch" not in body


def test_string_data_only_secret_counts_utf8_bytes() -> None:
    d = decide(review(secret(string_data={"cfg": "é" * (65 * KIB)})))  # 2 bytes each: 130 KiB
    assert not d.allowed and "130 KiB" in d.message


def test_string_data_overrides_same_key_in_data_instead_of_double_counting() -> None:
    d = decide(review(secret(data={"k": b64(100 * KIB)}, string_data={"k": "x" * 10})))
    assert d.allowed and not d.warnings


def test_binary_data_is_counted_decoded() -> None:
    # 120 KiB binary is 160 KiB of base64: must be judged on the 120 KiB.
    d = decide(review(secret(data={"blob": b64(120 * KIB)})))
    assert d.allowed and d.outcome == "warned"


def test_exactly_at_hard_limit_is_allowed_one_byte_over_is_denied() -> None:
    # The key "a" is the 128 Ki-th byte.
    at = decide(review(secret(data={"a": b64(128 * KIB - 1)}, annotations={})))
    over = decide(review(secret(data={"a": b64(128 * KIB)}, annotations={})))
    assert at.allowed and at.outcome == "warned"
    assert not over.allowed and "128 KiB, over the 128 KiB" not in over.message
    assert "is 128 KiB" not in over.message  # 128.0 KiB + 1 byte must not print as the limit itself


def test_exactly_at_soft_limit_has_no_warning() -> None:
    assert not decide(review(secret(data={"a": b64(32 * KIB - 1)}))).warnings  # the key is the last byte
    assert decide(review(secret(data={"a": b64(32 * KIB)}))).warnings


def test_last_applied_annotation_counts_toward_size() -> None:
    payload = b64(70 * KIB)
    last_applied = '{"data":{"a":"' + payload + '"}}'
    obj = secret(data={"a": payload},
                 annotations={"kubectl.kubernetes.io/last-applied-configuration": last_applied})
    d = decide(review(obj))
    assert not d.allowed and "of annotations" in d.message
    d2 = decide(review(obj), SecretSettings(count_annotations=False))
    assert d2.allowed


def test_soft_limit_warning_is_short_and_names_the_object() -> None:
    d = decide(review(secret(data={"a": b64(40 * KIB)})))
    assert d.allowed and d.outcome == "warned"
    (w,) = response("u", d)["response"]["warnings"]
    assert len(w) <= 120 and "team-a/model-certs" in w and "32 KiB" in w


def test_generate_name_secret_is_labelled_by_its_prefix() -> None:
    d = decide(review(secret(name="", generate_name="tok-", data={"a": b64(200 * KIB)})))
    assert "secret team-a/tok-* is 200 KiB" in d.message


def test_shrinking_update_of_oversized_secret_is_allowed_with_warning() -> None:
    old = secret(data={"a": b64(300 * KIB)})
    new = secret(data={"a": b64(200 * KIB)})
    d = decide(review(new, operation="UPDATE", old=old))
    assert d.allowed and d.outcome == "warned" and "still over" in d.warnings[0]


def test_growing_update_of_oversized_secret_is_denied() -> None:
    d = decide(review(secret(data={"a": b64(250 * KIB)}), operation="UPDATE",
                      old=secret(data={"a": b64(200 * KIB)})))
    assert not d.allowed


def _managed(*managers: str, fields: dict | None = None) -> list[dict]:  # type: ignore[type-arg]
    """managedFields as the apiserver writes them: one Update entry per field manager."""
    return [{"manager": m, "operation": "Update", "apiVersion": "v1", "time": "2026-12-02T10:25:31Z",
             "fieldsType": "FieldsV1", "fieldsV1": fields or {"f:metadata": {"f:labels": {"f:team": {}}}}}
            for m in managers]


def _labelled(team: str, managed: list[dict]) -> dict:  # type: ignore[type-arg]
    obj = secret(data={"a": b64(200 * KIB)})
    obj["metadata"]["labels"] = {"team": team}
    obj["metadata"]["managedFields"] = managed
    return obj


def test_a_new_field_manager_relabelling_an_oversized_secret_is_allowed() -> None:
    """The apiserver's own managedFields entry for a new manager (~170 bytes here) is not the object growing: a
    controller changing one label of a legacy 200 KiB Secret was denied "over the 128 KiB limit" (sandbox: the
    same patch by kubectl's own manager passed, by --field-manager=other-controller it was refused)."""
    old = _labelled("a", _managed("kubectl-label"))
    new = _labelled("b", _managed("kubectl-label", "other-controller"))
    d = decide(review(new, operation="UPDATE", old=old))
    assert d.allowed and d.outcome == "warned" and "does not grow" in d.warnings[0]


def test_an_oversized_secret_may_not_grow_through_its_managed_fields_past_the_allowance() -> None:
    """Clients may write managedFields of any size: past ``oversizedManagedFields`` (absolute, so repeated
    updates cannot ratchet it up) they grow the object like data does."""
    padding = {"f:metadata": {"f:labels": {f"f:pad-{i}": {} for i in range(400)}}}
    old = _labelled("a", _managed("kubectl-label"))
    assert not decide(review(_labelled("a", _managed("kubectl-label", "x", fields=padding)),
                             operation="UPDATE", old=old)).allowed
    past_allowance = _labelled("a", _managed(*(f"m{i}" for i in range(30))))  # ~5 KiB of managedFields
    one_more = _labelled("a", _managed(*(f"m{i}" for i in range(31))))
    assert not decide(review(one_more, operation="UPDATE", old=past_allowance)).allowed
    assert decide(review(one_more, operation="UPDATE", old=past_allowance),
                  SecretSettings(oversized_managed_fields="64Ki")).allowed
    # Data may still not grow beside a new manager's entry (which alone would be allowed).
    bigger = _labelled("a", _managed("kubectl-label", "z"))
    bigger["data"]["b"] = b64(1)
    assert not decide(review(bigger, operation="UPDATE", old=_labelled("a", _managed("kubectl-label")))).allowed


def test_update_that_crosses_the_limit_is_denied() -> None:
    d = decide(review(secret(data={"a": b64(150 * KIB)}), operation="UPDATE",
                      old=secret(data={"a": b64(10 * KIB)})))
    assert not d.allowed


def test_delete_is_never_blocked() -> None:
    old = secret(data={"a": b64(900 * KIB)})
    d = decide(review(None, operation="DELETE", old=old, kind="Secret"))
    assert d.allowed and not d.warnings


def test_dry_run_gets_the_same_answer() -> None:
    obj = secret(data={"a": b64(212 * KIB)})
    real, dry = decide(review(obj)), decide(review(obj, dry_run=True))
    assert (real.allowed, real.message) == (dry.allowed, dry.message) == (False, real.message)


def test_helm_release_type_override_allows_large_release_secret() -> None:
    s = SecretSettings(overrides=[SizeOverride(types=["helm.sh/release.v1"], hard_limit="1536Ki",
                                               soft_limit="1Mi")])
    helm = secret("sh.helm.release.v1.app.v3", data={"release": b64(900 * KIB)}, type_="helm.sh/release.v1")
    assert decide(review(helm), s).allowed
    opaque = secret(data={"release": b64(900 * KIB)})
    assert not decide(review(opaque), s).allowed


def test_namespace_override_applies_only_to_its_namespace() -> None:
    s = SecretSettings(overrides=[SizeOverride(namespaces=["ml-legacy"], hard_limit="512Ki")])
    obj = secret(data={"a": b64(300 * KIB)})
    assert decide(review(obj, namespace="ml-legacy"), s).allowed
    assert not decide(review(obj, namespace="team-a"), s).allowed


def test_first_matching_override_wins() -> None:
    s = SecretSettings(overrides=[SizeOverride(namespaces=["ns"], hard_limit="64Ki"),
                                  SizeOverride(namespaces=["ns"], hard_limit="1Mi")])
    assert not decide(review(secret(data={"a": b64(100 * KIB)}), namespace="ns"), s).allowed


def test_config_maps_are_checked_only_when_enabled() -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big", "namespace": "team-a"},
          "data": {"a": "x" * (100 * KIB)}, "binaryData": {"b": b64(100 * KIB)}}
    req = request(review(cm))
    assert not secrets.handles(req, SecretSettings())
    on = SecretSettings(config_maps=True)
    d = secrets.review(req, on)
    assert not d.allowed and d.message.startswith("configmap team-a/big is 200 KiB")


def test_subresources_and_other_groups_are_not_handled() -> None:
    doc = review(secret(data={"a": b64(900 * KIB)}))
    doc["request"]["kind"]["group"] = "example.com"
    assert not secrets.handles(request(doc), SETTINGS)


def _padded(labels: int = 0, finalizers: int = 0, owners: int = 0,  # type: ignore[type-arg]
            managed: int = 0) -> dict:
    obj = secret(data={"token": b64(KIB)})
    meta = obj["metadata"]
    if labels:
        meta["labels"] = {f"pad-{i:05d}": "v" * 63 for i in range(labels)}
    if finalizers:
        meta["finalizers"] = [f"example.com/hold-{i:05d}-" + "f" * 40 for i in range(finalizers)]
    if managed:  # the apiserver stores the managedFields a client writes (any valid field set)
        meta["managedFields"] = [{"manager": "pad", "operation": "Update", "apiVersion": "v1",
                                  "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
                                  "fieldsV1": {"f:data": {f"f:k{i:05d}" + "x" * 60: {} for i in range(managed)}}}]
    if owners:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": f"owner-{i:05d}" + "o" * 100,
                                    "uid": f"{i:08d}-0000-0000-0000-000000000000"} for i in range(owners)]
    return obj


@pytest.mark.parametrize(("pad", "count"), [("labels", 2000), ("finalizers", 2500), ("owners", 1200),
                                            ("managed", 2000)])
def test_metadata_padding_counts_like_data(pad: str, count: int) -> None:
    """Nothing limits how many labels, finalizers or ownerReferences a Secret carries; they were not counted,
    so ~150 KiB of them passed a 128 KiB limit."""
    d = decide(review(_padded(**{pad: count})))
    assert not d.allowed and "over the 128 KiB limit" in d.message
    assert "of labels and other metadata" in d.message
    d = decide(review(_padded(**{pad: count}), operation="UPDATE", old=_padded(**{pad: count})))
    assert d.allowed and d.outcome == "warned"  # an oversized object that does not grow stays editable


def test_a_type_padded_to_150_kib_counts_like_data() -> None:
    d = decide(review(secret(data={"token": b64(KIB)}, type_="example.com/" + "t" * (150 * KIB))))
    assert not d.allowed and "of labels and other metadata" in d.message


def test_ordinary_labels_change_nothing() -> None:
    obj = secret(data={"tls.crt": b64(4 * KIB)})
    obj["metadata"]["labels"] = {"app.kubernetes.io/name": "web", "app.kubernetes.io/instance": "web-1"}
    obj["metadata"]["finalizers"] = ["example.com/keep"]
    d = decide(review(obj))
    assert d.allowed and not d.warnings and d.outcome == "allowed"


@pytest.mark.parametrize("where", ["data", "stringData", "configmap data", "binaryData"])
def test_keys_count_like_values(where: str) -> None:
    """The apiserver limits a key to 253 characters but not how many keys there are; keys were not counted, so
    2,500 keys of 240 characters with empty values (600 KB stored and LISTed) were a Secret of 0 bytes."""
    keys = {f"k{i:05d}-" + "k" * 233: "" for i in range(2500)}
    if where in ("data", "stringData"):
        obj = secret(data=keys) if where == "data" else secret(string_data=keys)
        d = decide(review(obj))
    else:
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "keys", "namespace": "team-a"},
              "data" if where == "configmap data" else "binaryData": keys}
        d = secrets.review(request(review(cm)), SecretSettings(config_maps=True))
    assert not d.allowed and "is 585.9 KiB, over the 128 KiB limit" in d.message


def test_a_key_in_data_and_stringdata_counts_once() -> None:
    assert secrets.object_size("Secret", secret(data={"k" * 200: b64(10)}, string_data={"k" * 200: "x"}),
                               True).data == 201


def _terminating(obj: dict) -> dict:  # type: ignore[type-arg]
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj["metadata"]["finalizers"] = ["example.com/hold"]
    return obj


def test_an_object_being_deleted_cannot_grow_past_the_limit() -> None:
    """A finalizer nobody removes keeps a deleted Secret stored and LISTed; every UPDATE of one was allowed, so
    create small, add a finalizer, delete, then write 900 KiB into it."""
    old = _terminating(secret(data={"a": b64(KIB)}))
    d = decide(review(_terminating(secret(data={"a": b64(900 * KIB)})), operation="UPDATE", old=old))
    assert not d.allowed and "is 900 KiB, over the 128 KiB limit" in d.message


def test_finishing_a_deletion_is_never_blocked() -> None:
    """Removing the finalizer of an oversized object being deleted (it shrinks) is allowed; so is any update of
    one under the limit, without soft-limit warnings."""
    old = _terminating(secret(data={"a": b64(900 * KIB)}))
    new = _terminating(secret(data={"a": b64(900 * KIB)}))
    new["metadata"]["finalizers"] = []
    d = decide(review(new, operation="UPDATE", old=old))
    assert d.allowed and d.outcome == "warned"
    old = _terminating(secret(data={"a": b64(40 * KIB)}))
    d = decide(review(_terminating(secret(data={"a": b64(100 * KIB)})), operation="UPDATE", old=old))
    assert d.allowed and d.outcome == "allowed" and not d.warnings
