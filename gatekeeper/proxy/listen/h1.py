"""HTTP/1.1 client connections on h11: keep-alive, streamed bodies, upgrade passthrough.

``Expect: 100-continue`` is answered when the pipeline first pulls the body, so a rejected request never makes the
client upload. goawayChance's ``Connection: close`` must be in the head, so the coin is tossed when the head is written.
The socket is watched for hang-ups while a response is produced, so a client leaving an idle watch ends it upstream.
``Content-Length`` with ``Transfer-Encoding`` is a 400 (request smuggling, RFC 9112 6.3). Timeouts and limits are in
docs/proxy/limits.md."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import select
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import h11

from gatekeeper.proxy import rejections
from gatekeeper.proxy.adapter import (
    HOP_BY_HOP,
    ClientGone,
    DeadlinePassed,
    call_handler,
    close_body,
    decode_header,
    describe_seconds,
    encode_header,
    response_has_body,
    status_json,
    timeout_response,
)
from gatekeeper.proxy.listen import conn_metrics
from gatekeeper.proxy.listen.goaway import GoawayDecider
from gatekeeper.proxy.listen.h1_tunnel import READ_SIZE, splice, upgrade_answer
from gatekeeper.proxy.listen.settings import ProtocolSettings
from gatekeeper.proxy.messages import Handler, Headers, ProxyRequest, ProxyResponse, Upgraded, is_exhausted

LINGER_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 s: close() sends RST and drops unsent bytes."""

log = logging.getLogger("gatekeeper.proxy.listen.h1")

PIPELINE_BUFFER_LIMIT = 65536
"""Pipelined bytes read ahead while a response is running; beyond this we stop reading."""
HANGUP_CHECK_SECONDS = 1.0
"""How often a connection whose read-ahead is full is checked for a client hang-up (a poll, nothing read)."""
_HANGUP_EVENTS = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)
UNREAD_BODY_DRAIN_BYTES = 256 * 1024
"""A request body the pipeline never read is drained up to this size to keep the connection; else close."""


def peer_hung_up(fd: int) -> bool:
    """Whether the peer of ``fd`` sent its FIN (POLLRDHUP) or reset, without reading a byte."""
    poller = select.poll()
    poller.register(fd, _HANGUP_EVENTS)
    return any(events & _HANGUP_EVENTS for _, events in poller.poll(0))


class H1Connection:
    """Serve one HTTP/1.1 connection until the client leaves, asks to close, or we close it."""

    def __init__(
        self,
        handler: Handler,
        settings: ProtocolSettings,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        peer: str = "",
        peer_cert: dict[str, Any] | None = None,
        connection_id: int = 0,
        rng: Callable[[], float] = random.random,
        draining: bool = False,
    ) -> None:
        """``draining``: the drain began during this connection's handshake: answer its first request with
        ``Connection: close``, and that is all."""
        self._handler = handler
        self._settings = settings
        self._reader, self._writer = reader, writer
        self._peer, self._peer_cert = peer, peer_cert
        self._memo: dict[str, Any] = {}
        """ProxyRequest.connection_memo of every request on this connection."""
        self.connection_id = connection_id
        self._decider = GoawayDecider(settings.goaway_chance, rng)
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=settings.max_header_list_bytes)
        self._closing = False
        self._draining = draining
        self._idle = True
        self._eof = False
        self._request_done = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        """The current exchange's EOF watcher (it reads the client while a response is produced)."""
        self.closed = asyncio.Event()

    # ------------------------------------------------------------------ public

    def shutdown(self) -> None:
        """Graceful close: an idle connection closes now, a busy one after its current response."""
        self._closing = True
        if self._idle:
            self._writer.close()

    async def run(self) -> None:
        try:
            await self._serve()
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            log.debug("http/1.1 connection %d from %s ended: %s", self.connection_id, self._peer, exc)
        finally:
            self.closed.set()
            self._writer.close()

    # ------------------------------------------------------------------ request loop

    async def _serve(self) -> None:
        while not self._closing:
            self._idle = True
            try:
                event = await self._next_event(idle=True)
            except h11.RemoteProtocolError as exc:
                await self._bad_request(exc)
                return
            self._idle = False
            if isinstance(event, h11.ConnectionClosed) or event is None:
                return
            if not isinstance(event, h11.Request):  # pragma: no cover - h11 guarantees order
                return
            names = {bytes(k) for k, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                await self._bad_request(h11.RemoteProtocolError(
                    "Content-Length together with Transfer-Encoding (RFC 9112 6.3); send one of them",
                    error_status_hint=400), reason="length_and_chunked")
                return
            size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
            if size > self._settings.max_header_list_bytes:
                # h11 only bounds *incomplete* heads; a head that arrived whole is checked here.
                limit = self._settings.max_header_list_bytes
                await self._bad_request(h11.RemoteProtocolError(
                    f"request head is {size} bytes, over the {limit}-byte limit", error_status_hint=431))
                return
            if len(event.headers) > self._settings.h1_max_header_fields:
                # A head parsed whole from bytes read ahead (pipelined) skipped the line count in _next_event.
                await self._bad_request(self._too_many_fields(len(event.headers)))
                return
            keep_going = await self._exchange(event)
            if not keep_going or self._draining or self._conn.our_state is not h11.DONE:
                return
            if self._conn.their_state is not h11.DONE and not await self._drain_unread_body():
                return
            try:
                self._conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _next_event(self, *, idle: bool = False, body: bool = False) -> h11.Event | type[h11.PAUSED] | None:
        """The next h11 event; None when the connection must close (idle, or the head came too slowly). ``idle``:
        waiting for a head; ``body``: reading a body (idle timeout per read, raises ClientGone)."""
        head_deadline: float | None = None
        head_lines = 0
        """Line ends read while this head is incomplete (an upper bound on its header fields)."""
        loop = asyncio.get_running_loop()
        while True:
            event = self._conn.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            if idle and head_lines > self._settings.h1_max_header_fields + 1:  # + the request line
                # Refused before h11 parses it: h11 costs ~4 us per field, so a 1 MiB head of empty fields
                # held the event loop for a second.
                raise self._too_many_fields(head_lines - 1)
            if self._eof:
                return h11.ConnectionClosed()
            if idle and self._conn.their_state is h11.IDLE and not self._conn.trailing_data[0]:
                try:
                    async with asyncio.timeout(self._settings.idle_timeout_seconds):
                        data = await self._reader.read(READ_SIZE)
                except TimeoutError:
                    return None
                head_deadline = loop.time() + self._settings.h1_header_timeout_seconds
            elif idle:
                if head_deadline is None:
                    head_deadline = loop.time() + self._settings.h1_header_timeout_seconds
                try:
                    async with asyncio.timeout_at(head_deadline):
                        data = await self._reader.read(READ_SIZE)
                except TimeoutError:
                    rejections.reject("header_timeout", f"{self._peer}: request head incomplete after "
                                   f"{self._settings.h1_header_timeout_seconds:g}s")
                    return None
            elif body:
                try:
                    async with asyncio.timeout(self._settings.h1_body_idle_timeout_seconds):
                        data = await self._reader.read(READ_SIZE)
                except TimeoutError:
                    self._closing = True
                    rejections.reject("body_timeout", f"{self._peer}: request body idle for "
                                   f"{self._settings.h1_body_idle_timeout_seconds:g}s")
                    raise ClientGone("request body idle too long") from None
            else:
                data = await self._reader.read(READ_SIZE)
            if not data:
                self._eof = True
            elif idle:
                head_lines += data.count(b"\n")  # C speed; bytes past the head only make it larger
            self._conn.receive_data(data)

    def _too_many_fields(self, fields: int) -> h11.RemoteProtocolError:
        limit = self._settings.h1_max_header_fields
        return h11.RemoteProtocolError(f"request head has {fields} or more header fields, over the limit of {limit}",
                                       error_status_hint=431)

    async def _bad_request(self, exc: h11.RemoteProtocolError, *, reason: rejections.RejectReason | None = None,
                           ) -> None:
        """Malformed request line or headers: a 4xx Status, then close (framing is lost)."""
        code = exc.error_status_hint
        if reason is None:
            reason = "h1_head_too_large" if code == 431 else "h1_malformed"
        rejections.reject(reason, f"{self._peer}: {exc}")
        if self._conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status_reason = "RequestHeaderFieldsTooLarge" if code == 431 else "BadRequest"
        body = status_json(code, status_reason, f"malformed HTTP/1.1 request: {exc}")
        try:
            headers = [("content-type", "application/json"), ("content-length", str(len(body))),
                       ("connection", "close")]
            self._write(h11.Response(status_code=code, headers=headers))
            self._write(h11.Data(data=body))
            self._write(h11.EndOfMessage())
            await self._writer.drain()
        except (h11.LocalProtocolError, ConnectionError):
            pass

    def _request(self, event: h11.Request) -> ProxyRequest:
        headers: Headers = [(decode_header(bytes(k)), decode_header(bytes(v))) for k, v in event.headers]
        has_body = any(
            (k == "content-length" and v.strip() != "0") or k == "transfer-encoding" for k, v in headers
        )
        request = ProxyRequest(
            method=decode_header(bytes(event.method)),
            target=decode_header(bytes(event.target)),
            headers=headers,
            body=None,
            protocol="http/1.1",
            peer=self._peer,
            peer_cert=self._peer_cert,
            connection_id=self.connection_id,
            connection_memo=self._memo,
        )
        if has_body:
            request.body = self._request_body()
        return request

    async def _request_body(self) -> AsyncIterator[bytes]:
        if self._conn.they_are_waiting_for_100_continue:
            self._write(h11.InformationalResponse(status_code=100, headers=[]))
            await self._writer.drain()
        while True:
            try:
                event = await self._next_event(body=True)
            except h11.RemoteProtocolError as exc:  # broken chunked framing: the request fails (400), we close
                self._closing = True
                rejections.reject("h1_malformed", f"{self._peer}: request body: {exc}")
                raise
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._request_done.set()
                return
            else:
                raise ClientGone("client closed the connection during the request body")

    # ------------------------------------------------------------------ one exchange

    async def _exchange(self, event: h11.Request) -> bool:
        """Run the handler and write its response; False when the connection must close."""
        request = self._request(event)
        self._request_done = asyncio.Event()
        if request.body is None:
            end = await self._next_event()  # no body: EndOfMessage is already parsed
            if not isinstance(end, h11.EndOfMessage):
                return False
            self._request_done.set()
        task = asyncio.create_task(self._respond(request))
        watcher = self._watcher = asyncio.create_task(self._watch_eof(task))
        try:
            return await task
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():
                return False  # the client hung up; _respond already finished the response
            task.cancel()
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch_eof(self, task: asyncio.Task[bool]) -> None:
        """Notice the client hanging up once the request is read (idle watches, unanswered upgrades: nothing
        else would end those). Bytes read meanwhile stay in h11 for the next request or the tunnel."""
        await self._request_done.wait()
        buffered = 0
        try:
            while buffered < PIPELINE_BUFFER_LIMIT:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    break
                buffered += len(data)
                self._conn.receive_data(data)  # a pipelined next request: h11 keeps it for later
            else:
                await self._hangup_unread()
        except (ConnectionError, OSError):
            pass  # a reset (a client killed with bytes unread, SO_LINGER 0): as gone as at EOF
        self._eof = True
        task.cancel()

    async def _hangup_unread(self) -> None:
        """Return once the client has gone, reading nothing (the read-ahead is full).

        A paused transport sees no EOF or reset, so a client that pipelined past the read-ahead and left kept its
        request running upstream, forever on an idle watch. The kernel is polled for FIN/RST instead."""
        transport = self._writer.transport
        sock = transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        # is_closing first: once the transport closed, the fd number may already be another connection's.
        while not (transport.is_closing() or self._reader.exception() is not None  # noqa: ASYNC110
                   or (fd >= 0 and peer_hung_up(fd))):  # the kernel's state has no event for us to await
            await asyncio.sleep(HANGUP_CHECK_SECONDS)

    async def _respond(self, request: ProxyRequest) -> bool:
        response: ProxyResponse | None = None
        error: BaseException | None = None
        try:
            if request.header("upgrade") is None:
                response = await call_handler(self._handler, request)
            else:
                response = await upgrade_answer(self._handler, request, self._settings, self._peer)
                if response is None:
                    return False
            if response.upgraded is not None:
                return await self._upgrade(request, response, response.upgraded)
            return await self._send(request, response)
        except asyncio.CancelledError:
            if request.timed_out and not self._eof:
                error = await self._past_deadline(request)
            else:
                error = ClientGone("client closed the connection" if self._eof else "connection closed")
            return False
        except (ConnectionError, OSError) as exc:
            error = ClientGone(f"client connection failed: {exc}")
            return False
        except Exception as exc:  # h11 LocalProtocolError (e.g. body longer than content-length), body errors
            error = exc
            log.warning("http/1.1 response to %s %s failed: %s", request.method, request.target, exc)
            return False
        finally:
            if response is not None and response.upgraded is None:
                await close_body(response.body)
                response.finish(error)

    async def _past_deadline(self, request: ProxyRequest) -> BaseException:
        """The request's deadline passed: a 504 and close if nothing was answered, else close mid-response
        (HTTP/1.1 cannot cut one response). Returns the error the response finishes with."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        error = DeadlinePassed(f"{self._peer} {request.method}: not done within "
                               f"{describe_seconds(request.deadline_seconds)}")
        transport = self._writer.transport
        if self._conn.our_state is h11.SEND_RESPONSE:  # no head written yet
            with contextlib.suppress(ConnectionError, OSError, h11.LocalProtocolError, asyncio.CancelledError):
                await self._send(request, timeout_response(request.deadline_seconds), close=True)
        elif (sock := transport.get_extra_info("socket")) is not None:
            # Reset, not FIN: a plain close would leave the kernel sending what it holds (megabytes of send
            # buffer) to a client that reads a trickle, which then sees the cut minutes later.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
        transport.abort()
        return error

    async def _send(self, request: ProxyRequest, response: ProxyResponse, *, close: bool = False) -> bool:
        headers = [(encode_header(k), encode_header(v)) for k, v in response.headers if k not in HOP_BY_HOP]
        if not close:  # else the caller closes the connection after this response (a 504 at the deadline)
            if self._closing or self._draining:
                close = True
                conn_metrics.GOAWAY_SENT.labels(reason="shutdown").inc()
            elif self._decider.decide():
                close = True
                conn_metrics.GOAWAY_SENT.labels(reason="chance").inc()
        if close:
            headers.append((b"connection", b"close"))
        self._write(h11.Response(status_code=response.status, headers=headers))
        if response_has_body(request.method, response.status):
            body = response.body
            async for chunk in body:
                if not chunk:
                    continue
                if is_exhausted(body):
                    # The last chunk (upstream knows it): chunk and end of message in one write.
                    self._write_all(h11.Data(data=chunk), h11.EndOfMessage())
                    await self._drain()
                    return not close
                self._write(h11.Data(data=chunk))
                await self._drain()
        self._write(h11.EndOfMessage())
        await self._drain()
        return not close

    async def _drain(self) -> None:
        """Wait for the client to take the response; abort the connection if it stalls too long."""
        if self._writer.transport.get_write_buffer_size() <= self._settings.write_buffer_low_bytes:
            await self._writer.drain()  # not paused: returns at once, no timer to arm (the common case)
            return
        try:
            async with asyncio.timeout(self._settings.h1_write_stall_timeout_seconds):
                await self._writer.drain()
        except TimeoutError:
            rejections.reject("response_stall", f"{self._peer}: took no response bytes for "
                           f"{self._settings.h1_write_stall_timeout_seconds:g}s")
            self._writer.transport.abort()
            raise ClientGone("client stopped reading the response") from None

    async def _upgrade(self, request: ProxyRequest, response: ProxyResponse, up: Upgraded) -> bool:
        """Write the backend's 101 head, then splice bytes both ways until one side closes."""
        error: BaseException | None = None
        try:
            if response.status != 101 or self._conn.their_state is not h11.MIGHT_SWITCH_PROTOCOL:
                raise RuntimeError(f"upgrade response {response.status} to a request that did not ask for it")
            # Upgrade/Connection are the point of a 101: keep every header the backend sent.
            headers = [(encode_header(k), encode_header(v)) for k, v in response.headers]
            self._write(h11.InformationalResponse(status_code=101, headers=headers))
            await self._writer.drain()
            watcher, self._watcher = self._watcher, None
            if watcher is not None:  # from here the tunnel reads the client; stop reading it there
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            early, _ = self._conn.trailing_data
            if early:
                up.writer.write(early)
                await up.writer.drain()
            await splice(self._reader, self._writer, self._drain, up, self._settings, self._peer)
        except asyncio.CancelledError:
            error = ClientGone("connection closed during an upgraded session")
            raise
        except Exception as exc:
            error = exc
            raise
        finally:
            up.writer.close()
            response.finish(error)
            if up.on_close is not None:
                await up.on_close()
        return False

    def _write(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            self._writer.write(data)

    def _write_all(self, *events: h11.Event) -> None:
        """Several events as one transport write (one TLS record, one send)."""
        data = b"".join(self._conn.send(e) or b"" for e in events)
        if data:
            self._writer.write(data)

    async def _drain_unread_body(self) -> bool:
        """The pipeline answered without reading the request body; read and drop a little of it."""
        if self._conn.they_are_waiting_for_100_continue:
            return False
        left = UNREAD_BODY_DRAIN_BYTES
        try:
            async with asyncio.timeout(1.0):
                while left > 0:
                    event = await self._next_event()
                    if isinstance(event, h11.Data):
                        left -= len(event.data)
                    elif isinstance(event, h11.EndOfMessage):
                        return True
                    else:
                        return False
        except (TimeoutError, h11.RemoteProtocolError):
            return False
        return False
