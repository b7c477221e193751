"""The SSE writer: events ready together share one write; a client that left stops the stream."""

import asyncio

from turbine.frontend.event_stream import EventStreamResponse


def serve(events, ready_flags, client_leaves_after=None):
    """Run the response against a minimal ASGI server; returns (body writes, events closed?)."""
    sent, closed = [], []
    flags = iter(ready_flags)

    async def gen():
        try:
            for e in events:
                yield e
        finally:
            closed.append(True)

    async def main():
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append(message)
                if client_leaves_after is not None and len(sent) >= client_leaves_after:
                    left.set()
                    await asyncio.sleep(0)

        await EventStreamResponse(gen(), more_ready=lambda: next(flags))(
            {"type": "http"}, receive, send)

    asyncio.run(main())
    return sent, bool(closed)


def test_events_ready_together_go_out_in_one_write():
    sent, closed = serve([b"a", b"b", b"c", b"d"], [True, True, False, False])
    assert [m["body"] for m in sent] == [b"abc", b"d", b""]
    assert [m["more_body"] for m in sent] == [True, True, False]
    assert closed


def test_a_client_that_left_stops_the_stream():
    sent, closed = serve([b"a", b"b", b"c"], [False, False, False], client_leaves_after=1)
    assert [m["body"] for m in sent] == [b"a"]  # nothing after the client left, no final write
    assert closed
