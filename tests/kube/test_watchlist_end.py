"""The initial-events-end bookmark is found in a watch-list's bytes as the apiserver frames them, and only there.

The JSON and protobuf shapes below are the v1.37.2 apiserver's (captured with curl from the sandbox; the sandbox test
tests/flowcontrol/test_sandbox_watch_lists.py reads real streams too): one event per line, or 4-byte length frames.
"""

from __future__ import annotations

import gzip
import json

import pytest

from gatekeeper.kube.watchlist import BOOKMARK_MAX, InitialEventsEnd

END_ANNOTATION = {"k8s.io/initial-events-end": "true"}


def json_event(kind: str, obj: dict) -> bytes:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


def secret(name: str, annotations: dict | None = None, data: str = "Yg==") -> dict:
    meta: dict = {"name": name, "namespace": "ns", "resourceVersion": "7"}
    if annotations:
        meta["annotations"] = annotations
    return {"kind": "Secret", "apiVersion": "v1", "metadata": meta, "data": {"a": data}}


BOOKMARK = json_event("BOOKMARK", {"kind": "Secret", "apiVersion": "v1",
                                   "metadata": {"resourceVersion": "9", "annotations": END_ANNOTATION}})


def pb_string(field: int, value: bytes) -> bytes:
    assert len(value) < 128
    return bytes([field << 3 | 2, len(value)]) + value


def pb_varint_len(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb_bytes(field: int, value: bytes) -> bytes:
    return bytes([field << 3 | 2]) + pb_varint_len(len(value)) + value


def pb_event(kind: bytes, annotations: dict[str, str] | None = None, payload: bytes = b"") -> bytes:
    """A protobuf WatchEvent frame as the apiserver writes it: type, then the object in a k8s\\0 Unknown envelope."""
    meta = pb_string(4, b"") + pb_string(6, b"9")
    for k, v in (annotations or {}).items():
        meta += pb_bytes(12, pb_string(1, k.encode()) + pb_string(2, v.encode()))
    obj = pb_bytes(1, meta) + pb_bytes(2, payload)
    unknown = b"k8s\x00" + pb_bytes(1, pb_string(1, b"v1") + pb_string(2, b"Secret")) + pb_bytes(2, obj)
    event = pb_string(1, kind) + pb_bytes(2, pb_bytes(1, unknown))
    return len(event).to_bytes(4, "big") + event


def feed_in_steps(scanner: InitialEventsEnd, data: bytes, step: int) -> int | None:
    """Feed ``data`` ``step`` bytes at a time; the offset of the chunk in which the end was found."""
    for i in range(0, len(data), step):
        if scanner.feed(data[i : i + step]):
            return i
    return None


@pytest.mark.parametrize("step", [1, 2, 5, 17, 64, 1 << 20])
def test_the_json_bookmark_is_found_whatever_the_chunking(step):
    stream = b"".join(json_event("ADDED", secret(f"s{i}")) for i in range(5)) + BOOKMARK
    s = InitialEventsEnd("application/json")
    at = feed_in_steps(s, stream + json_event("MODIFIED", secret("later")), step)
    assert at is not None and at <= len(stream) - 1 < at + step
    assert s.decoded >= len(stream) and s.ended


@pytest.mark.parametrize("step", [1, 3, 10, 100, 1 << 20])
def test_the_protobuf_bookmark_is_found_whatever_the_chunking(step):
    stream = b"".join(pb_event(b"ADDED", payload=b"x" * 300) for _ in range(4)) + pb_event(b"BOOKMARK", END_ANNOTATION)
    s = InitialEventsEnd("application/vnd.kubernetes.protobuf;stream=watch")
    at = feed_in_steps(s, stream, step)
    assert at is not None and at <= len(stream) - 1 < at + step


@pytest.mark.parametrize("step", [1, 7, 300, 1 << 20])
def test_a_gzip_stream_of_several_members_is_inflated_on_the_fly(step):
    """The apiserver's gzip writer (WatchListCompression) ends a member per flush; members follow each other."""
    events = [json_event("ADDED", secret(f"s{i}", data="QUJD" * 500)) for i in range(3)]
    stream = gzip.compress(b"".join(events)) + gzip.compress(BOOKMARK)
    s = InitialEventsEnd("application/json", "gzip")
    assert feed_in_steps(s, stream, step) is not None
    assert s.decoded == sum(map(len, events)) + len(BOOKMARK)  # the initial events' size, decoded


def test_an_object_that_carries_the_marker_does_not_end_the_sync():
    """A tenant writes the annotation on its own Secret, and a custom resource nests a whole fake bookmark event:
    neither starts a line, so neither is the apiserver's bookmark."""
    fake_event = {"type": "BOOKMARK", "object": {"metadata": {"annotations": END_ANNOTATION}}}
    spoofs = (json_event("ADDED", secret("a", END_ANNOTATION))
              + json_event("ADDED", {"kind": "Thing", "spec": fake_event})
              + json_event("ADDED", secret("b", data='\n{"type":"BOOKMARK","object":{"metadata":{"annotations":'
                                                     '{"k8s.io/initial-events-end":"true"}}}}')))
    s = InitialEventsEnd("application/json")
    assert not s.feed(spoofs)
    assert s.feed(BOOKMARK)


def test_a_protobuf_object_that_carries_the_marker_does_not_end_the_sync():
    s = InitialEventsEnd("application/vnd.kubernetes.protobuf;stream=watch")
    spoof = pb_event(b"ADDED", END_ANNOTATION, payload=b"\x0a\x08BOOKMARK" + b"\x0a\x19k8s.io/initial-events-end")
    assert not s.feed(spoof * 3)
    assert s.feed(pb_event(b"BOOKMARK", END_ANNOTATION))


def test_a_bookmark_without_the_annotation_or_too_long_is_not_the_end():
    plain = json_event("BOOKMARK", {"kind": "Secret", "metadata": {"resourceVersion": "8"}})
    huge = json_event("BOOKMARK", {"kind": "Secret", "metadata": {"resourceVersion": "8", "annotations": {
        **END_ANNOTATION, "pad": "x" * BOOKMARK_MAX}}})
    s = InitialEventsEnd("application/json")
    assert not s.feed(plain + huge)
    assert s.feed(BOOKMARK)


@pytest.mark.parametrize(("content_type", "encoding"), [
    ("application/cbor-seq", ""), ("application/yaml", ""), ("application/json", "br"), ("", "")])
def test_a_format_it_cannot_read_is_unsupported_not_guessed(content_type, encoding):
    s = InitialEventsEnd(content_type, encoding)
    assert not s.supported
    assert not s.feed(BOOKMARK)


def test_a_corrupt_gzip_stream_gives_up_instead_of_raising():
    s = InitialEventsEnd("application/json", "gzip")
    assert not s.feed(b"\x1f\x8b\x08\x00garbage-not-deflate" * 4)
    assert not s.supported
    assert not s.feed(gzip.compress(BOOKMARK))


def test_memory_stays_bounded_however_long_an_event_is():
    s = InitialEventsEnd("application/json")
    s.feed(b'{"type":"ADDED","object":{"data":"' + b"A" * (4 << 20))
    assert len(s._event) <= len(b'{"type":"BOOKMARK"')
    s.feed(b'"}}\n' + BOOKMARK)
    assert s.ended


def test_a_table_watch_lists_bookmark_ends_it_though_a_table_carries_no_annotation():
    """``Accept: application/json;as=Table`` (v1.37.2): the bookmark is a Table without annotations; waiting for the
    annotation would let any tenant hold a seat until watchListSyncSeconds by asking for a Table."""
    table = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": "5"},
             "columnDefinitions": [], "rows": []}
    s = InitialEventsEnd("application/json")
    assert not s.feed(json_event("ADDED", table))
    assert s.feed(json_event("BOOKMARK", table))
