"""The request plane's cluster-key handshake and TLS: a peer that does not prove the key is cut
off before any of its bytes are decoded, and logged; a client is not fooled by a fake server."""

import asyncio
import logging
import os

import pytest

from tests.tls_certs import make_tls_files
from turbine.protocol.frames import REQUEST, Frame
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime import request_plane
from turbine.runtime.cluster_auth import (
    CLIENT_PROOF_BYTES,
    MAGIC,
    SERVER_HELLO_BYTES,
    ClusterAuth,
    RateLimitedWarning,
    TlsFiles,
)
from turbine.runtime.codec import encode
from turbine.runtime.errors import ConnectFailed, PeerDisconnected
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer, encode_frame

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = b"k" * 32
OTHER_KEY = b"o" * 32


def req(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", token_ids=[7], stop=StopConditions(max_tokens=2))


class Watch:
    """What the server did with a peer's bytes: handler runs and frames parsed (any FrameReader)."""

    def __init__(self, monkeypatch):
        self.handled = 0
        self.fed: list[bytes] = []
        feed = request_plane.FrameReader.feed

        def counting_feed(reader, data):
            self.fed.append(bytes(data))
            return feed(reader, data)

        monkeypatch.setattr(request_plane.FrameReader, "feed", counting_feed)
        # Every refusal logged (the limiter would hide all but the first in 10 s).
        monkeypatch.setattr(request_plane, "_warn_refused", RateLimitedWarning(request_plane.logger))

    async def generate(self, r: GenerateRequest, ctx):
        self.handled += 1
        for i in range(2):
            yield GenerateOutput(token_ids=[i])


@pytest.fixture
async def watch(monkeypatch):
    return Watch(monkeypatch)


async def start_server(watch: Watch, auth: ClusterAuth) -> RequestPlaneServer:
    server = RequestPlaneServer(auth=auth)
    server.register("generate", GenerateRequest, watch.generate)
    await server.start()
    return server


async def collect(stream) -> list:
    async with asyncio.timeout(5):
        return [item async for item in stream]


async def raw_peer(port: int, send: bytes) -> tuple[bytes, str]:
    """Connects, sends `send`, reads until the server closes; returns (bytes read, our address)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    me = "%s:%d" % writer.get_extra_info("sockname")[:2]
    if send:
        writer.write(send)
    got = b""
    try:
        async with asyncio.timeout(5):
            while chunk := await reader.read(65536):
                got += chunk
    except ConnectionResetError:
        pass
    writer.close()
    return got, me


async def test_the_same_key_serves(watch):
    server = await start_server(watch, ClusterAuth(KEY))
    client = RequestPlaneClient(auth=ClusterAuth(KEY))
    try:
        out = await collect(client.stream(server.address, "generate", req(), GenerateOutput))
        assert [o.token_ids for o in out] == [[0], [1]]
        assert watch.handled == 1
    finally:
        await client.close()
        await server.stop()


async def test_a_wrong_key_is_cut_off_before_decoding_and_logged(watch, caplog):
    server = await start_server(watch, ClusterAuth(KEY))
    client = RequestPlaneClient(auth=ClusterAuth(OTHER_KEY), connect_timeout=2)
    caplog.set_level(logging.WARNING, "turbine.request_plane")
    try:
        with pytest.raises(ConnectFailed, match="cluster-key handshake"):
            await collect(client.stream(server.address, "generate", req(), GenerateOutput))
        assert watch.handled == 0 and watch.fed == []  # no frame parsed on either side
        refusals = [r.getMessage() for r in caplog.records if "failed the cluster-key handshake" in r.getMessage()]
        assert any("wrong cluster key" in m and "127.0.0.1:" in m for m in refusals), refusals
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize("what", ["a request frame", "garbage", "half a proof then garbage"])
async def test_a_raw_peer_without_the_key_is_cut_off_before_decoding(watch, caplog, what):
    server = await start_server(watch, ClusterAuth(KEY))
    caplog.set_level(logging.WARNING, "turbine.request_plane")
    frame = bytes(encode_frame(Frame(kind=REQUEST, stream_id=1, endpoint="generate", payload=encode(req())),
                               1 << 20))
    send = {"a request frame": frame, "garbage": os.urandom(200),
            "half a proof then garbage": MAGIC + b"\x00" * 10 + b"x" * 100}[what]
    try:
        got, me = await raw_peer(server.port, send)
        assert got.startswith(MAGIC) and len(got) == SERVER_HELLO_BYTES  # the hello, and nothing else
        assert watch.handled == 0 and watch.fed == []
        assert any(f"refused {me}, which failed the cluster-key handshake" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        await server.stop()


async def test_a_silent_peer_is_cut_off_after_the_handshake_timeout(watch, caplog, monkeypatch):
    monkeypatch.setattr(request_plane, "HANDSHAKE_TIMEOUT_S", 0.3)
    server = await start_server(watch, ClusterAuth(KEY))
    caplog.set_level(logging.WARNING, "turbine.request_plane")
    try:
        got, me = await raw_peer(server.port, b"")
        assert len(got) == SERVER_HELLO_BYTES
        assert any(f"refused {me}" in r.getMessage() and "no cluster-key proof within 0.3s" in r.getMessage()
                   for r in caplog.records)
        assert server._connections == set()
    finally:
        await server.stop()


async def test_a_client_without_the_key_gets_a_clear_error_and_nothing_is_handled(watch, caplog):
    server = await start_server(watch, ClusterAuth(KEY))
    client = RequestPlaneClient(auth=ClusterAuth(), connect_timeout=2)
    caplog.set_level(logging.WARNING, "turbine.request_plane")
    try:
        # Either the hello came before the request went out (refused at once) or after (the
        # server cut the request off undecoded): never served.
        with pytest.raises((ConnectFailed, PeerDisconnected), match="requires a cluster key|lost"):
            await collect(client.stream(server.address, "generate", req(), GenerateOutput))
        assert watch.handled == 0
        messages = [r.getMessage() for r in caplog.records]
        assert any("it requires a cluster key" in m or "does not speak the cluster-key handshake" in m
                   for m in messages), messages
    finally:
        await client.close()
        await server.stop()


async def test_a_client_with_a_key_refuses_a_server_without_one(watch):
    server = await start_server(watch, ClusterAuth())
    client = RequestPlaneClient(auth=ClusterAuth(KEY), connect_timeout=0.5)
    try:
        with pytest.raises(ConnectFailed, match="did not complete the cluster-key handshake"):
            await collect(client.stream(server.address, "generate", req(), GenerateOutput))
        assert watch.handled == 0
    finally:
        await client.close()
        await server.stop()


async def test_a_fake_server_that_cannot_prove_the_key_never_sees_a_request(watch, caplog):
    """Mutual: a server that says hello but answers the proof with anything gets no request."""
    received = bytearray()

    async def fake(reader, writer):
        writer.write(MAGIC + os.urandom(32))
        received.extend(await reader.readexactly(CLIENT_PROOF_BYTES))
        writer.write(os.urandom(32))  # not the proof
        try:
            async with asyncio.timeout(2):
                while chunk := await reader.read(65536):
                    received.extend(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        writer.close()

    fake_server = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = fake_server.sockets[0].getsockname()[1]
    client = RequestPlaneClient(auth=ClusterAuth(KEY), connect_timeout=2)
    caplog.set_level(logging.WARNING, "turbine.request_plane")
    try:
        with pytest.raises(ConnectFailed, match="failed to prove the cluster key"):
            await collect(client.stream(f"127.0.0.1:{port}", "generate", req(), GenerateOutput))
        await asyncio.sleep(0.1)
        assert len(received) == CLIENT_PROOF_BYTES  # the proof only: no request frame
        assert any(f"refused the server at 127.0.0.1:{port}" in r.getMessage() for r in caplog.records)
    finally:
        await client.close()
        fake_server.close()


def tls(tmp_path, name="a") -> TlsFiles:
    return TlsFiles(*make_tls_files(tmp_path / name, ca_name=f"CA {name}"))


async def test_tls_with_the_key_serves_and_the_wire_is_encrypted(watch, tmp_path):
    files = tls(tmp_path)
    server = await start_server(watch, ClusterAuth(KEY, files))
    client = RequestPlaneClient(auth=ClusterAuth(KEY, files))
    try:
        out = await collect(client.stream(server.address, "generate", req(), GenerateOutput))
        assert [o.token_ids for o in out] == [[0], [1]]
        # A plain-TCP peer sees a TLS server: no hello in clear text, and it is cut off.
        got, _ = await raw_peer(server.port, b"\x16\x03\x01\x00\x05hello")
        assert MAGIC not in got
    finally:
        await client.close()
        await server.stop()


async def test_tls_refuses_a_client_of_another_ca_and_a_plain_client(watch, tmp_path):
    server = await start_server(watch, ClusterAuth(None, tls(tmp_path, "a")))
    stranger = RequestPlaneClient(auth=ClusterAuth(None, tls(tmp_path, "b")), connect_timeout=2)
    plain = RequestPlaneClient(auth=ClusterAuth(), connect_timeout=2)
    try:
        with pytest.raises(ConnectFailed, match="TLS"):
            await collect(stranger.stream(server.address, "generate", req(), GenerateOutput))
        with pytest.raises((ConnectFailed, PeerDisconnected)):
            await collect(plain.stream(server.address, "generate", req(), GenerateOutput))
        assert watch.handled == 0
    finally:
        await stranger.close()
        await plain.close()
        await server.stop()


async def test_keys_shorter_than_16_bytes_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ClusterAuth(b"short")


async def test_event_signatures_are_checked():
    auth = ClusterAuth(KEY)
    signed = auth.sign(b"kv-events", b"payload")
    assert auth.verified(b"kv-events", signed) == b"payload"
    assert auth.verified(b"load-metrics", signed) is None  # bound to its topic
    assert ClusterAuth(OTHER_KEY).verified(b"kv-events", signed) is None
    assert auth.verified(b"kv-events", b"payload") is None  # unsigned
    assert auth.verified(b"kv-events", b"") is None
    assert ClusterAuth().sign(b"kv-events", b"payload") == b"payload"  # no key: as before
