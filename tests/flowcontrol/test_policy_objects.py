"""v1 FlowSchema / PriorityLevelConfiguration validation: errors name the object and the field."""

from __future__ import annotations

import copy

import pytest
from fc_helpers import flow_schema, group, queued_level, rr, secrets_list_schema

from gatekeeper.proxy.flowcontrol.core.objects import ObjectError, parse_flow_schema, parse_priority_level
from gatekeeper.proxy.flowcontrol.core.policy import build_policy, split_objects

GOOD_FS = secrets_list_schema()


def _broken(path: list, value) -> dict:
    obj = copy.deepcopy(GOOD_FS)
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    if value is KeyError:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    ("path", "value", "field", "words"),
    [
        (
            ["spec", "rules", 0, "subjects", 0, "kind"],
            "Robot",
            "spec.rules[0].subjects[0].kind",
            "User, Group",
        ),
        (["spec", "matchingPrecedence"], 0, "spec.matchingPrecedence", "[1, 10000]"),
        (["spec", "distinguisherMethod"], {"type": "ByColour"}, "spec.distinguisherMethod.type", "ByUser"),
        (
            ["spec", "rules", 0, "resourceRules", 0, "verbs"],
            [],
            "spec.rules[0].resourceRules[0].verbs",
            "empty",
        ),
        (
            ["spec", "rules", 0, "resourceRules", 0, "verbs"],
            ["*", "get"],
            "resourceRules[0].verbs",
            "only member",
        ),
        (["spec", "rules", 0, "resourceRules", 0, "clusterScope"], "yes", "clusterScope", "true or false"),
        (
            ["spec", "rules", 0, "resourceRules", 0],
            rr(["list"], ["secrets"], namespaces=(), cluster=False),
            "spec.rules[0].resourceRules[0]",
            "clusterScope",
        ),
        (["spec", "rules", 0, "bogus"], 1, "spec.rules[0].bogus", "unknown field"),
        (["spec", "priorityLevelConfiguration"], {}, "spec.priorityLevelConfiguration", "missing"),
        (["apiVersion"], "v1", "apiVersion", "flowcontrol.apiserver.k8s.io/v1"),
    ],
)
def test_flow_schema_error_names_object_and_field(path, value, field, words):
    with pytest.raises(ObjectError) as exc:
        parse_flow_schema(_broken(path, value))
    msg = str(exc.value)
    assert msg.startswith("FlowSchema/secrets-list: ")
    assert field in msg and words in msg


def test_nonresource_wildcard_only_as_final_segment():
    fs = flow_schema(
        "x",
        "l",
        [{"subjects": [group("*")], "nonResourceRules": [{"verbs": ["get"], "nonResourceURLs": ["/hea*"]}]}],
    )
    with pytest.raises(ObjectError, match=r"FlowSchema/x: spec.rules\[0\].nonResourceRules\[0\].nonResourceURLs\[0\]"):
        parse_flow_schema(fs)


def test_priority_level_queue_shape_is_checked():
    with pytest.raises(ObjectError, match=r"PriorityLevelConfiguration/big: .*handSize: must not be greater"):
        parse_priority_level(queued_level("big", 1, queues=4, hand=8))
    with pytest.raises(ObjectError, match=r"handSize: .*bits of entropy"):
        parse_priority_level(queued_level("big", 1, queues=1024, hand=7))
    ok = parse_priority_level(queued_level("ok", 3, queues=128, hand=6, qlen=10))
    assert (ok.queues, ok.hand_size, ok.queue_length_limit, ok.nominal_concurrency_shares) == (128, 6, 10, 3)


def test_unknown_priority_level_reference_is_reported():
    with pytest.raises(ObjectError, match=r"FlowSchema/secrets-list: spec.priorityLevelConfiguration.name: no Pri"):
        build_policy([("f[0]", GOOD_FS)], 100)


def test_list_documents_and_kubectl_dumps_load():
    dumped = copy.deepcopy(GOOD_FS)
    dumped["metadata"].update(uid="1234", resourceVersion="9", annotations={"a": "b"})
    dumped["status"] = {"conditions": []}
    docs = [{"kind": "List", "apiVersion": "v1", "items": [dumped, queued_level("secrets-list", 2)]}, None]
    policy = build_policy(split_objects(docs, "f.yaml"), 100)
    assert [fs.uid for fs in policy.schemas if fs.name == "secrets-list"] == ["1234"]
