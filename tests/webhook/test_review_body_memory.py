"""What a worker holds to read a review's body, and gives back after decoding a large one (the worst case in
docs/webhook/hardening.md).

aiohttp's ``request.read()`` held a body about twice: a growing ``bytearray``, then its copy as ``bytes``. The
handler now reads it into one buffer of its size. Measured with tracemalloc around the handler: the body is
padded with whitespace after the document, so that decoding it makes almost nothing and the peak is the body's
buffers. The stream's chunks are allocated before tracing starts (the parser made them), so they are not counted.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import orjson
import pytest
from aiohttp import StreamReader, web
from aiohttp.test_utils import make_mocked_request
from review_fixtures import b64, review, secret

from gatekeeper.webhook import app as webhook_app
from gatekeeper.webhook.app import build_app, metrics, validate
from gatekeeper.webhook.body import TRIM_AFTER_BYTES, BodyTooLarge, heap_trimmer, read_body
from gatekeeper.webhook.settings import GpuSettings, ServerSettings, WebhookSettings

MIB = 1024 * 1024
CHUNK = 64 * 1024


class _Protocol:
    """What a StreamReader calls on its connection (a Mock would keep a record of every call)."""

    _reading_paused = False
    connected = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


def _stream(body: bytes, *, eof: bool = True) -> StreamReader:
    stream = StreamReader(_Protocol(), 2**16, loop=asyncio.get_running_loop())
    for i in range(0, len(body), CHUNK):
        stream.feed_data(body[i:i + CHUNK])
    if eof:
        stream.feed_eof()
    return stream


def _settings(max_body: int = 6 * MIB) -> WebhookSettings:
    return WebhookSettings(server=ServerSettings(max_body_bytes=max_body), gpu=GpuSettings(enabled=False))


def _request(doc: bytes, settings: WebhookSettings | None = None) -> web.Request:
    app = build_app(settings or _settings())
    return make_mocked_request("POST", "/validate", headers={"Content-Length": str(len(doc)),
                                                              "Content-Type": "application/json"},
                               payload=_stream(doc), app=app, client_max_size=app._client_max_size)


async def _post(doc: bytes, settings: WebhookSettings | None = None) -> tuple[int, Any]:
    resp = await validate(_request(doc, settings))
    return resp.status, resp.body


async def test_a_review_body_is_held_once_while_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak of traced memory from the handler's start to the moment the body, read whole, is decoded."""
    doc = orjson.dumps(review(secret(data={"a": b64(1024)})))
    body = doc + b" " * (4 * MIB)  # whitespace after the document
    req = _request(body)
    await _post(doc)  # the first review's one-time costs (metrics' children, caches) are not the body's
    peaks: list[int] = []
    real = webhook_app.parse_review

    def decoding(read: bytes | bytearray | memoryview) -> Any:
        peaks.append(tracemalloc.get_traced_memory()[1])
        return real(read)

    monkeypatch.setattr(webhook_app, "parse_review", decoding)
    tracemalloc.start()
    try:
        resp = await validate(req)
    finally:
        tracemalloc.stop()
    assert resp.status == 200 and orjson.loads(resp.body)["response"]["allowed"] is True  # type: ignore[arg-type]
    # One buffer of the body's size; aiohttp's read() held a growing bytearray and its copy, ~2x.
    assert peaks and peaks[0] < 1.1 * len(body), f"peak {peaks[0] / MIB:.2f} MiB for {len(body) / MIB:.2f} MiB"


async def test_a_chunked_body_is_read_whole_and_cut_past_the_limit() -> None:
    body = orjson.dumps(review(secret(data={"a": b64(300 * 1024)})))
    got = await read_body(_stream(body), None, 1 * MIB)
    assert bytes(got) == body and len(got) == len(body)
    with pytest.raises(BodyTooLarge):
        await read_body(_stream(b"x" * (MIB + 1)), None, MIB)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("length", [None, 256 * MIB], ids=["chunked", "declared"])
async def test_a_body_still_arriving_holds_only_what_arrived(length: int | None) -> None:
    """Waiting for the rest of a body, the buffer is resident only where bytes were written: a chunked body (for
    which the budget reserves maxBodyBytes) or a long declared one does not cost its full size from the first
    byte (a zeroed bytearray does, and what the stream holds meanwhile came on top)."""
    stream = _stream(b"x" * MIB, eof=False)
    before = _rss()
    reading = asyncio.create_task(read_body(stream, length, 256 * MIB))
    await asyncio.sleep(0.05)  # it copied the first MiB and waits for more
    grown = _rss() - before
    stream.feed_data(b"y" * MIB)
    if length is None:
        stream.feed_eof()
        got = await reading
        assert len(got) == 2 * MIB and bytes(got[MIB - 1:MIB + 1]) == b"xy"
    else:
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
    assert grown < 32 * MIB, f"{grown / MIB:.0f} MiB resident for 1 MiB received"


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    stream = _stream(b"", eof=False)  # nothing arrives: reading would wait forever
    with pytest.raises(BodyTooLarge):
        await asyncio.wait_for(read_body(stream, MIB + 1, MIB), 5)


async def test_a_too_large_review_is_answered_413_and_counted() -> None:
    before = metrics().refused.labels("validate", "too-large")._value.get()
    status, _ = await _post(b"x" * (256 * 1024 + 1), _settings(256 * 1024))
    assert status == 413
    assert metrics().refused.labels("validate", "too-large")._value.get() == before + 1


@pytest.mark.parametrize(("size", "trims"), [(TRIM_AFTER_BYTES, 1), (TRIM_AFTER_BYTES - 1, 0), (20 * 1024, 0)])
async def test_the_heap_is_trimmed_after_a_large_review_only(monkeypatch: pytest.MonkeyPatch, size: int,
                                                             trims: int) -> None:
    """malloc_trim gives back what a large decode fragmented (47-89 MiB a worker kept after one; the README's figures
    are in loadtest/reports/2026-12-03-readme-history.md); after a small review it would cost a few microseconds for
    nothing, so it is not called."""
    calls: list[int] = []
    monkeypatch.setattr(webhook_app, "_TRIM", lambda: calls.append(1))
    doc = orjson.dumps(review(secret(data={"a": b64(1024)})))
    status, _ = await _post(doc + b" " * (size - len(doc)))
    assert status == 200 and len(calls) == trims


def test_the_heap_trimmer_is_glibc_malloc_trim_or_nothing() -> None:
    import os

    trim = heap_trimmer()
    try:
        glibc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        glibc = False
    assert (trim is not None) == glibc
    if trim is not None:
        trim()  # callable, returns


@pytest.mark.timeout(30)
async def test_an_empty_body_is_read_as_empty_every_time() -> None:
    """aiohttp hands every bodiless request one shared empty payload, whose readchunk says "chunk boundary" for
    ever once read: taken for a boundary, the second empty review looped the worker (never yielding, so only the
    timeout mark ends the test then)."""
    from aiohttp.streams import EMPTY_PAYLOAD

    for _ in range(3):
        assert len(await asyncio.wait_for(read_body(EMPTY_PAYLOAD, 0, MIB), 5)) == 0
        assert len(await asyncio.wait_for(read_body(EMPTY_PAYLOAD, None, MIB), 5)) == 0
