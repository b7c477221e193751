"""A text/event-stream response written straight to the ASGI server.

Starlette's StreamingResponse costs, per request, a task group that listens for the
client leaving and, per chunk, a trip through every middleware's `send` wrapper. Here the
disconnect is one pending `receive()` and each write goes straight to the server. Events
that are ready together (the worker's outputs arrived in a burst while the loop was busy)
go out in one write instead of one write each: when the frontend is the bottleneck, this
cuts its per-token work to what the clients can see.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStreamResponse:
    def __init__(self, events: AsyncGenerator[bytes, None], more_ready: Callable[[], bool]):
        """`events` yields encoded SSE events; `more_ready()` says whether the next one
        will come without waiting (then it is held back and written with the next)."""
        self.events = events
        self.more_ready = more_ready
        self.status_code = 200
        self.raw_headers = _HEADERS  # as a Starlette Response's (replaced, never changed in place)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        # The request body was read already: the next message is the client leaving (or,
        # harmlessly, the end of this response).
        left = asyncio.ensure_future(receive())
        pending: list[bytes] = []
        gone = False
        try:
            async for event in self.events:
                pending.append(event)
                if self.more_ready():
                    continue
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                pending.clear()
                if left.done() and left.result()["type"] == "http.disconnect":
                    gone = True
                    break  # closing the events cancels the request on its worker
        finally:
            await self.events.aclose()
            if not left.done():
                left.cancel()
        if not gone:
            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
