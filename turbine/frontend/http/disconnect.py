"""Noticing a client that leaves before its answer is complete, so that its work stops.

A non-streamed answer is written only when the whole request is done, so nothing is written
that could fail while it runs: without a watch a client that gave up (a timeout, a closed tab)
would leave its request generating on the engine until `max_tokens`. `ClientWatch` wraps the
request's ASGI `receive`: the body passes through, and the one message that comes after it
(the server's `http.disconnect`, when the client closes the connection or the response is
over) is held for everyone who waits for it — the watch itself and a streamed response, which
checks for it between writes (event_stream.py). `run(work)` runs the request's handler and
cancels it when the client leaves first; cancelling closes the request's worker streams, which
aborts the engine requests (and a remote prefill, an encode job: dispatch.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class ClientWatch:
    def __init__(self, receive):
        self._receive = receive
        self._body_read = asyncio.Event()
        self._after_body: asyncio.Future | None = None
        self.left = False  # the client left before the work was done

    async def receive(self) -> dict[str, Any]:
        """The ASGI `receive` to hand the request and the response."""
        if self._body_read.is_set():
            return await asyncio.shield(self._next_message())
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_read.set()
        return message

    def _next_message(self) -> asyncio.Future:
        if self._after_body is None:
            self._after_body = asyncio.ensure_future(self._receive())
        return self._after_body

    async def run(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when the client left first (then `work` was cancelled and has
        finished its cleanup; `left` is True)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self._gone())
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        self.left = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def _gone(self) -> None:
        await self._body_read.wait()  # the body is the handler's to read first
        while (await asyncio.shield(self._next_message()))["type"] != "http.disconnect":
            self._after_body = None  # not a disconnect (no server sends one): wait for the next

    def close(self) -> None:
        """The response is over: stop waiting for the client."""
        if self._after_body is not None and not self._after_body.done():
            self._after_body.cancel()
