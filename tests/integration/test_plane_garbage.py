"""Garbage on the internal planes, against real processes: a simulated worker (turbine.mocker)
fed garbage bytes, oversized frames, undecodable and hostile requests on its request-plane port
stays up and keeps serving; garbage published on the event plane (a real NATS server) under the
worker's own subjects leaves the KV-routing frontend's consumers running.

If the planes require a cluster key, an unauthenticated peer is cut off before any frame is
decoded; the processes must stay up either way, which is what these tests assert first."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
import time

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.procs import (
    base_env,
    free_port,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL
from turbine.protocol import errors as codes
from turbine.protocol.frames import END, ERROR, REQUEST, Frame
from turbine.protocol.generate import GenerateRequest, SamplingOptions, StopConditions
from turbine.protocol.kv_events import KvEventBatch
from turbine.protocol.load_metrics import LoadMetrics
from turbine.runtime.codec import decode, encode
from turbine.runtime.request_plane import FrameReader, encode_frame

MODEL = DEFAULT_MODEL
MAX_FRAME = 32 << 20
CONTEXT = 256


@pytest.fixture(scope="module")
def planes(tmp_path_factory, nats_url):
    root = tmp_path_factory.mktemp("plane-garbage")
    env = base_env(str(root / "discovery"))
    port = free_port()
    mocker = start_mocker("garbage-mocker", env, root, "--speedup-ratio", "0", "--max-model-len", str(CONTEXT),
                          "--block-size", "16", "--port", str(port), "--event-plane", "nats",
                          "--nats-server", nats_url)
    frontend = start_frontend("garbage-frontend", env, root, "--router-mode", "kv")
    procs = [mocker, frontend]
    try:
        wait_until(lambda: worker_ready(mocker), 60, "mocker ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "frontend sees the mocker", procs)
        yield {"mocker": mocker, "frontend": frontend, "address": ("127.0.0.1", port)}
    finally:
        for p in procs:
            p.stop()


def chat(frontend, text: str) -> httpx.Response:
    return httpx.post(f"{frontend.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": text}]})


def serves(planes) -> None:
    assert planes["mocker"].alive() and planes["frontend"].alive()
    r = chat(planes["frontend"], "still there?")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


class RawPeer:
    """A TCP peer speaking (or not) the request plane's frames, by hand."""

    def __init__(self, address):
        self.sock = socket.create_connection(address, timeout=10)
        self.reader = FrameReader(MAX_FRAME)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, stream_id: int, payload: bytes, endpoint: str = "generate") -> None:
        self.send(bytes(encode_frame(Frame(kind=REQUEST, stream_id=stream_id, endpoint=endpoint, payload=payload),
                                     MAX_FRAME)))

    def last_frame(self, stream_id: int) -> Frame:
        """The END or ERROR frame that closes `stream_id` (chunks before it are skipped)."""
        while True:
            data = self.sock.recv(1 << 16)
            assert data, "the worker closed the connection"
            for frame in self.reader.feed(data):
                if frame.stream_id == stream_id and frame.kind in (END, ERROR):
                    return frame

    def closed_by_peer(self) -> bool:
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # someone's HTTP client on the wrong port
    struct.pack(">I", 2**32 - 1) + b"x" * 4096,  # a 4 GiB frame announced: refused before buffering
    struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # a frame that is not msgpack
    struct.pack(">I", 3) + b"\x93\x01\x02",  # msgpack, not a Frame
], ids=["http", "huge-length", "not-msgpack", "not-a-frame"])
def test_garbage_bytes_close_the_connection_and_the_worker_serves_on(planes, garbage):
    peer = RawPeer(planes["address"])
    try:
        peer.send(garbage)
        assert peer.closed_by_peer()
    finally:
        peer.close()
    serves(planes)


def test_bad_payloads_get_typed_errors_on_a_connection_that_stays_open(planes):
    """Undecodable requests are answered on their own stream (invalid_request, never internal),
    and the same connection then serves a good request."""
    peer = RawPeer(planes["address"])
    deep = b"\x84" + b"".join(msgspec.msgpack.encode(x) for x in ("request_id", "r", "model", MODEL, "token_ids", [1],
                                                                "kv_transfer_params")) + b"\x81\xa1x" + b"\x91" * 100_000 + b"\xc0"
    try:
        for sid, payload in enumerate([b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"model": 1}),
                                       deep], start=1):
            peer.request(sid, payload)
            frame = peer.last_frame(sid)
            assert frame.kind == ERROR and frame.code == codes.INVALID_REQUEST, frame
        peer.request(99, b"", endpoint="no-such-endpoint")
        assert peer.last_frame(99).code == codes.UNKNOWN_ENDPOINT
        good = GenerateRequest(request_id="ok", model=MODEL, token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2))
        peer.request(100, encode(good))
        assert peer.last_frame(100).kind == END
    finally:
        peer.close()
    serves(planes)


token_ids = st.lists(st.integers(-5, 60_000), max_size=8) | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)
maybe_int = st.none() | st.integers(-3, 40) | st.integers(-(2**63), 2**63 - 1)
requests = st.builds(
    lambda ids, n, max_tokens, min_tokens, stop_ids, ignore_eos, dp_rank: GenerateRequest(
        request_id="fuzz", model=MODEL, token_ids=ids, sampling=SamplingOptions(n=n),
        stop=StopConditions(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_ids,
                            ignore_eos=ignore_eos), dp_rank=dp_rank),
    token_ids, st.integers(-2, 20) | st.integers(-(2**63), 2**63 - 1), maybe_int, maybe_int,
    st.none() | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3), st.booleans(), maybe_int)


def test_hostile_requests_get_an_answer_not_a_crash(planes):
    """Well-formed requests with any values (ids outside the vocabulary, n and lengths out of
    range, 64-bit extremes, ranks the worker lacks): each stream ends with END or an
    invalid_request ERROR, in bounded time, and the worker serves on."""
    peer = RawPeer(planes["address"])
    counter = iter(range(1, 10**9))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests)
    def one(req):
        sid = next(counter)
        peer.request(sid, encode(req))
        frame = peer.last_frame(sid)  # a request that never ended would time out the socket (10 s)
        assert frame.kind == END or frame.code == codes.INVALID_REQUEST, (req, frame)

    try:
        one()
    finally:
        peer.close()
    serves(planes)


def _applied(frontend) -> float:
    return metric(http_text(f"{frontend.url}/metrics"), "turbine_router_kv_events_applied_total")


async def test_garbage_on_the_event_plane_leaves_the_router_consuming(planes, nats_url):
    from nats.aio.client import Client

    frontend = planes["frontend"]
    assert chat(frontend, "warm the cache " * 8).status_code == 200
    wait_until(lambda: _applied(frontend) > 0, 15, "the router applied the worker's KV events", [frontend])
    labels = re.search(r'turbine_router_worker_kv_total_blocks\{[^}]*worker="([^"]+)"',
                       http_text(f"{frontend.url}/metrics"))
    instance = labels.group(1).split(":")[0]
    good_load = LoadMetrics(instance_id=instance, kv_active_blocks=0, kv_total_blocks=1, num_running=0, num_waiting=0)
    garbage = [b"", b"\xc1" * 64, os.urandom(4096), msgspec.msgpack.encode({"instance_id": instance}),
               b"\x91" * 100_000 + b"\xc0",
               encode(KvEventBatch(instance_id=instance, event_id=10**12, events=[], dp_rank=7)),
               encode(msgspec.structs.replace(good_load, dp_rank=99))]
    client = Client()
    await client.connect(nats_url)
    try:
        for topic in ("kv-events", "load-metrics", "no-such-topic"):
            for payload in garbage:
                await client.publish(f"turbine.events.{instance}.{topic}", payload)
        await client.flush()
    finally:
        await client.close()
    before = _applied(frontend)
    await asyncio.sleep(0.5)
    assert frontend.alive()
    # The consumer still applies the worker's real events: a new prompt's blocks arrive.
    assert chat(frontend, "a different prompt to cache " * 8).status_code == 200
    deadline = time.monotonic() + 15
    while _applied(frontend) <= before and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert _applied(frontend) > before, frontend.log_tail()
    serves(planes)
