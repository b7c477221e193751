"""Stored responses shared by frontend processes through NATS JetStream's key-value store: two
frontend processes on one port (--frontend-processes 2 --response-store nats) in front of the
mocker, a private NATS server with JetStream; the official openai client. A follow-up sent to
the other process finds its parent (and a conversation its items); NATS killed mid-run makes
every stateful request a 503 (never a 404 or an answer without its context), and once NATS is
back (same storage) the same requests succeed with what was stored before."""

from __future__ import annotations

import httpx2
import openai
import psutil
import pytest

from tests.integration.procs import base_env, instances_of, start_frontend, start_mocker, stop_all, wait_until
from tests.nats_server import NatsServer

MODEL = "shared-store-model"


def _server_pid_of(frontend, local_port: int) -> int | None:
    """The frontend child process holding the server side of our connection from `local_port`."""
    for child in psutil.Process(frontend.popen.pid).children():
        try:
            for c in child.net_connections(kind="tcp"):
                if c.laddr and c.laddr.port == frontend.port and c.raddr and c.raddr.port == local_port:
                    return child.pid
        except psutil.NoSuchProcess:
            continue
    return None


def _our_ports(frontend) -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == frontend.port and c.status == psutil.CONN_ESTABLISHED}


def _pinned_client(frontend) -> tuple[openai.OpenAI, int]:
    """A client on one kept-alive connection, and the frontend process serving that connection."""
    before = _our_ports(frontend)
    http = httpx2.Client(limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1), timeout=30)
    client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", http_client=http, max_retries=0)
    client.models.list()
    mine = _our_ports(frontend) - before
    pids = {_server_pid_of(frontend, port) for port in mine} - {None}
    assert len(mine) == 1 and len(pids) == 1, (mine, pids)
    return client, pids.pop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_store")
    nats = NatsServer(root / "nats.log", jetstream_dir=root / "jetstream")
    nats.start()
    env = base_env(str(root / "discovery"))
    mocker = start_mocker("ss-mocker", env, root, "--served-model-name", MODEL, "--speedup-ratio", "0")
    frontend = start_frontend("ss-frontend", env, root, "--frontend-processes", "2", "--response-store", "nats",
                              "--response-store-nats-url", nats.url, "--response-store-ttl", "600")
    procs = [mocker, frontend]
    try:
        wait_until(lambda: all(instances_of(frontend, MODEL) == 1 for _ in range(8)), 120,
                   "the model in both frontend processes", procs)
        yield nats, frontend
    finally:
        stop_all(procs)
        nats.stop()


def test_a_follow_up_on_the_other_process_finds_its_parent_and_an_outage_is_a_503(stack):
    nats, frontend = stack
    first, first_pid = _pinned_client(frontend)
    for _ in range(40):  # the kernel spreads new connections over the two processes
        other, other_pid = _pinned_client(frontend)
        if other_pid != first_pid:
            break
        other.close()
    assert other_pid != first_pid

    parent = first.responses.create(model=MODEL, input="hello there", max_output_tokens=8)
    follow = other.responses.create(model=MODEL, input="and again", previous_response_id=parent.id,
                                    max_output_tokens=8)
    alone = other.responses.create(model=MODEL, input="and again", max_output_tokens=8, store=False)
    assert follow.previous_response_id == parent.id
    assert follow.usage.input_tokens > alone.usage.input_tokens + parent.usage.output_tokens  # it has the context
    assert other.responses.retrieve(parent.id).output_text == parent.output_text
    conversation = first.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    other.responses.create(model=MODEL, input="more", conversation=conversation.id, max_output_tokens=8)
    assert len(first.conversations.items.list(conversation.id).data) == 3

    nats.stop()  # SIGKILL: the store goes away mid-run
    for client in (first, other):
        for call in (lambda: client.responses.retrieve(parent.id),
                     lambda: client.responses.create(model=MODEL, input="x", previous_response_id=parent.id,
                                                     max_output_tokens=8),
                     lambda: client.responses.create(model=MODEL, input="x", conversation=conversation.id,
                                                     max_output_tokens=8),
                     lambda: client.responses.create(model=MODEL, input="x", max_output_tokens=8)):
            with pytest.raises(openai.InternalServerError) as info:
                call()
            assert info.value.status_code == 503, info.value
    # what needs no store is served meanwhile
    assert first.responses.create(model=MODEL, input="x", max_output_tokens=8, store=False).output_text

    nats.start()  # the same port and storage
    def back() -> bool:
        try:
            return all(c.responses.retrieve(parent.id).id == parent.id for c in (first, other))
        except openai.InternalServerError:
            return False

    wait_until(back, 30, "both frontend processes reading the store again", [frontend])
    again = other.responses.create(model=MODEL, input="and again", previous_response_id=parent.id,
                                   max_output_tokens=8)
    assert again.usage.input_tokens == follow.usage.input_tokens
    assert len(other.conversations.items.list(conversation.id).data) == 3


async def test_a_full_nats_bucket_drops_its_oldest_records_and_keeps_taking_new_ones(stack):
    from turbine.frontend.apis.state_store import NatsKv, StoreConfig

    nats, _ = stack
    kv = NatsKv(StoreConfig(kind="nats", nats_url=nats.url, bucket="full-bucket", max_bytes=64 << 10,
                            max_record_bytes=16 << 10))
    try:
        for i in range(24):  # 24 x 8 KiB into 64 KiB
            await kv.put(f"resp.{i}", bytes(8 << 10))
        assert await kv.get("resp.0") is None and (await kv.get("resp.23"))[0] == bytes(8 << 10)
    finally:
        await kv.close()
