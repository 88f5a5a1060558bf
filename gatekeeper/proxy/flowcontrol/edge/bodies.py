"""A response body that flow control watches as it goes to the client, when it is not read ahead (``readahead.py``).

It reports the end exactly once (the last chunk, an error, or the client closing it), says when the first bytes pass
(a watch is set up then), and feeds a watch-list's sync each chunk until the sync is over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from gatekeeper.proxy.messages import close_body, is_exhausted


class Metered:
    """Body wrapper: counts bytes and reports the end exactly once (end, error, or close)."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_end: Callable[[int, bool, BaseException | None, bytes], None],
        on_first: Callable[[], None] | None = None,
        until: Callable[[bytes], bool] | None = None,
    ):
        self.body = body
        self.on_end = on_end
        self.on_first = on_first
        self.until = until
        self.count = 0
        self.done = False
        self.head = b""

    def __aiter__(self) -> Metered:
        return self

    def _end(self, complete: bool, error: BaseException | None) -> None:
        if not self.done:
            self.done = True
            self.on_end(self.count, complete, error, self.head)

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        try:
            chunk = await self.body.__anext__()
        except StopAsyncIteration:
            self._end(True, None)
            raise
        except BaseException as exc:
            self._end(False, exc)
            raise
        if not self.head and chunk:
            self.head = chunk[:4096]
            if self.on_first is not None:
                first, self.on_first = self.on_first, None
                first()
        self.count += len(chunk)
        if self.until is not None and chunk and self.until(chunk):
            self.until = None
        if is_exhausted(self.body):
            self._end(True, None)  # the h2 adapter ends the stream on this chunk and reads no further
        return chunk

    @property
    def exhausted(self) -> bool:
        """The upstream body's last-chunk mark, passed through so the h2 adapter ends the stream on the last DATA."""
        return is_exhausted(self.body)

    async def aclose(self) -> None:
        self._end(False, None)
        await close_body(self.body)
