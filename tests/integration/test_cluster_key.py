"""The authenticated internal plane with real processes: simulated workers and a frontend that
share a cluster key serve the official openai client; a raw peer without the key is cut off by
the worker, which logs it; a worker with another key is skipped (its events dropped unread);
mutual TLS end to end."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest
from openai import OpenAI

from tests.integration.procs import base_env, free_port, http_text, instances_of, metric, start_frontend
from tests.integration.procs import start_mocker, wait_until, worker_ready
from tests.tls_certs import make_tls_files
from turbine.model.prepare import DEFAULT_MODEL
from turbine.protocol.frames import REQUEST, Frame
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime.cluster_auth import MAGIC, SERVER_HELLO_BYTES, ClusterAuth, TlsFiles
from turbine.runtime.codec import encode
from turbine.runtime.errors import ConnectFailed, PeerDisconnected
from turbine.runtime.request_plane import RequestPlaneClient, encode_frame

MODEL = DEFAULT_MODEL
KEY = "cluster-key-for-the-integration-test"
OTHER_KEY = "another-cluster-key-nobody-else-has"
MOCKER = ("--speedup-ratio", "0", "--block-size", "16")


def chat(frontend, text: str = "Say hi") -> str:
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=30)
    r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": text}])
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-key")
    env = base_env(str(root / "discovery"))
    env["TURBINE_CLUSTER_KEY"] = KEY  # the environment: keeps the key out of `ps`
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    worker = start_mocker("keyed-mocker", env, root, "--port", str(port), *MOCKER)
    rogue = start_mocker("other-key-mocker", env, root, "--cluster-key", OTHER_KEY, *MOCKER)
    frontend_env = dict(env)
    del frontend_env["TURBINE_CLUSTER_KEY"]
    frontend = start_frontend("keyed-frontend", frontend_env, root, "--cluster-key-file", str(key_file))
    kv_frontend = start_frontend("keyed-kv-frontend", env, root, "--router-mode", "kv")  # follows events
    procs = [worker, rogue, frontend, kv_frontend]
    try:
        wait_until(lambda: worker_ready(worker) and worker_ready(rogue), 60, "mockers ready", procs)
        for f in (frontend, kv_frontend):
            wait_until(lambda: instances_of(f, MODEL) == 2, 30, "frontend sees both workers", procs)
        yield {"worker": worker, "rogue": rogue, "frontend": frontend, "kv_frontend": kv_frontend,
               "address": f"127.0.0.1:{port}", "env": env, "root": root}
    finally:
        for p in procs:
            p.stop()


def test_the_same_key_serves_and_a_worker_with_another_key_is_skipped(keyed):
    replies = [chat(keyed["frontend"], f"Question {i}?") for i in range(6)]  # round robin over both
    assert all(replies), replies
    # The frontend tried the other-key worker: it refused the frontend, which went elsewhere.
    assert "wrong cluster key" in keyed["rogue"].log_path.read_text()
    log = keyed["frontend"].log_path.read_text()
    assert re.search(r"failed \(ConnectFailed: .*different cluster key, or none\); trying another", log), log
    text = http_text(f"{keyed['worker'].url}/metrics")
    assert metric(text, "turbine_worker_requests_total") >= 6  # the keyed worker served them all
    # Its load reports (and any KV events) are signed with another key: the KV router drops them unread.
    kv = keyed["kv_frontend"]
    wait_until(lambda: "b'load-metrics' message without a valid cluster-key signature" in kv.log_path.read_text(),
               15, "the kv frontend drops the other-key worker's events", [kv])


def test_a_raw_peer_without_the_key_is_cut_off_and_logged(keyed):
    host, port = keyed["address"].split(":")
    frame = encode_frame(Frame(kind=REQUEST, stream_id=1, endpoint="generate", payload=encode(
        GenerateRequest(request_id="raw", model=MODEL, token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2)))),
        1 << 20)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        me = "%s:%d" % sock.getsockname()[:2]
        sock.sendall(frame)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    assert got.startswith(MAGIC) and len(got) == SERVER_HELLO_BYTES  # the challenge, then cut off
    wait_until(lambda: f"refused {me}, which failed the cluster-key handshake" in
               keyed["worker"].log_path.read_text(), 10, "the worker logs the refusal", [keyed["worker"]])


def test_a_client_with_the_key_is_served_directly(keyed):
    async def call():
        client = RequestPlaneClient(auth=ClusterAuth(KEY.encode()))
        try:
            request = GenerateRequest(request_id="direct", model=MODEL, token_ids=[1, 2, 3],
                                      stop=StopConditions(max_tokens=2))
            return [o async for o in client.stream(keyed["address"], "generate", request, GenerateOutput)]
        finally:
            await client.close()

    assert len(asyncio.run(call())) >= 1


def test_mutual_tls_end_to_end(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-tls")
    cert, key, ca = make_tls_files(root / "tls")
    env = base_env(str(root / "discovery"))
    env.update(TURBINE_CLUSTER_KEY=KEY, TURBINE_TLS_CERT=cert, TURBINE_TLS_KEY=key, TURBINE_TLS_CA=ca)
    port = free_port()
    worker = start_mocker("tls-mocker", env, root, "--port", str(port), *MOCKER)
    frontend = start_frontend("tls-frontend", env, root)
    procs = [worker, frontend]
    try:
        wait_until(lambda: worker_ready(worker), 60, "mocker ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "frontend sees the worker", procs)
        assert all(chat(frontend, f"Over TLS {i}?") for i in range(3))

        async def plain_client():  # the right key, but no TLS: the handshake never starts
            client = RequestPlaneClient(auth=ClusterAuth(KEY.encode()), connect_timeout=2)
            request = GenerateRequest(request_id="plain", model=MODEL, token_ids=[1], stop=StopConditions(max_tokens=1))
            try:
                with pytest.raises(ConnectFailed):
                    async for _ in client.stream(f"127.0.0.1:{port}", "generate", request, GenerateOutput):
                        pass
            finally:
                await client.close()

        asyncio.run(plain_client())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"hello?")
            sock.settimeout(10)
            try:
                assert MAGIC not in sock.recv(65536)  # nothing in clear text
            except ConnectionResetError:
                pass
        assert re.search(r"turbine_worker_requests_total\S* [3-9]", http_text(f"{worker.url}/metrics"))
    finally:
        for p in procs:
            p.stop()


def test_the_router_service_serves_keyed_clients_only(keyed):
    """The standalone router (key from the environment) answers best_worker to a client with the
    key, not to one without, and drops the other-key worker's events unread."""
    from tests.integration.procs import _start
    from tests.integration.test_router_service import BS, ask, router_address
    from turbine.protocol.router import BestWorkerRequest

    router = _start("keyed-router", keyed["env"], keyed["root"], "turbine.router", "--system-port")
    try:
        wait_until(lambda: "serving best_worker" in router.log_path.read_text(errors="replace"), 30,
                   "router registered", [router])
        address = asyncio.run(router_address(keyed["env"]))
        request = BestWorkerRequest(model=MODEL, token_ids=list(range(4 * BS)))

        async def with_key(auth):
            client = RequestPlaneClient(auth=auth, connect_timeout=2)
            try:
                return await ask(client, address, request)
            finally:
                await client.close()

        assert asyncio.run(with_key(ClusterAuth(KEY.encode()))).instance_id
        with pytest.raises((ConnectFailed, PeerDisconnected)):
            asyncio.run(with_key(ClusterAuth()))
        wait_until(lambda: "without a valid cluster-key signature" in router.log_path.read_text(), 15,
                   "the router drops the other-key worker's events", [router])
    finally:
        router.stop()


def test_sleep_and_wake_on_the_status_port_need_the_key(keyed):
    # Anyone who reaches a status port could take a keyed worker out of service: its sleep and
    # wake routes act only for a caller that presents the cluster key.
    import json
    import urllib.error
    import urllib.request

    def post(route: str, key: str | None) -> int:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(f"{keyed['rogue'].url}/engine/{route}", data=b"{}", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            assert "cluster key" in json.loads(exc.read())["message"]
            return exc.code

    assert post("sleep", None) == 401
    assert post("sleep", KEY) == 401  # not this worker's key
    assert post("sleep", OTHER_KEY) == 200
    assert post("wake_up", None) == 401
    assert post("wake_up", OTHER_KEY) == 200
