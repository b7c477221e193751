"""Stored responses, in process: the memory store's bounds, and through the frontend's app with the
official client (a request-plane worker answering " hello world"): store by default, retrieve,
input items, delete, previous_response_id's context, conversations, background runs and their
cancel, one API key's records invisible to another, and a store that cannot be reached (a NATS
port with no server) answered 503."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from tests.unit.frontend.apis.test_responses import Worker
from turbine.config import ConfigError
from turbine.frontend.apis.state_store import Conflict, MemoryKv, StoreConfig
from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.http.api import asgi_app
from turbine.protocol.generate import GenerateRequest
from turbine.runtime.ports import free_port
from turbine.runtime.request_plane import RequestPlaneServer


# -- the memory store ---------------------------------------------------------------------
async def test_the_memory_store_drops_the_least_recently_used_past_its_count_and_bytes():
    kv = MemoryKv(StoreConfig(max_entries=2, max_record_bytes=1024, max_bytes=4096))
    await kv.put("a", b"1")
    await kv.put("b", b"2")
    assert await kv.get("a") == (b"1", 1)  # a is now the most recently used
    await kv.put("c", b"3")
    assert await kv.get("b") is None and (await kv.get("a"))[0] == b"1" and len(kv) == 2
    big = MemoryKv(StoreConfig(max_record_bytes=1024, max_bytes=2048))
    for key in "wxyz":
        await big.put(key, b"x" * 1000)
    assert big.bytes <= 2048 and [await big.get(k) is not None for k in "wxyz"] == [False, False, True, True]


async def test_the_memory_store_forgets_after_its_ttl_and_compares_before_it_sets(monkeypatch):
    kv = MemoryKv(StoreConfig(ttl_s=10))
    now = [1000.0]
    monkeypatch.setattr("turbine.frontend.apis.state_store.time.monotonic", lambda: now[0])
    revision = await kv.create("k", b"v")
    with pytest.raises(Conflict):
        await kv.create("k", b"again")
    with pytest.raises(Conflict):
        await kv.update("k", b"w", revision + 1)
    await kv.update("k", b"w", revision)
    now[0] += 11
    assert await kv.get("k") is None


def test_a_memory_store_is_refused_for_several_frontend_processes_and_auto_picks():
    assert FrontendConfig().store.kind == "memory"
    assert FrontendConfig(processes=2, http_port=8123).store.kind == "off"
    with pytest.raises(ConfigError, match="--response-store"):
        FrontendConfig(processes=2, http_port=8123, store=StoreConfig(kind="memory"))
    with pytest.raises(ConfigError, match="--response-store-max-bytes"):
        StoreConfig(max_bytes=10, max_record_bytes=1024)


# -- through the app ----------------------------------------------------------------------
@pytest.fixture
async def frontend_of(tokenizer):
    """Makes (worker, frontend, client for an API key) stacks on one worker."""
    worker = Worker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    made = []

    def make(cfg: FrontendConfig = FrontendConfig(), key: str = "k"):
        frontend = Frontend(cfg)
        frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
        app = asgi_app(frontend)
        made.append(frontend)

        def client(api_key: str = key):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend")
            return openai.AsyncOpenAI(base_url="http://frontend/v1", api_key=api_key, http_client=http,
                                      max_retries=0)

        return frontend, client

    yield worker, make
    for frontend in made:
        await frontend.background.close()
        await frontend.client.close()
        if frontend.kv is not None:
            await frontend.kv.close()
    await server.stop()


async def test_a_response_is_stored_by_default_and_can_be_read_listed_and_deleted(frontend_of):
    _, make = frontend_of
    _, client_of = make()
    client = client_of()
    r = await client.responses.create(model="m", input="hi", metadata={"k": "v"})
    assert r.store is True
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = await client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hi")]
    deleted = await client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError, match=r.id):
        await client.responses.retrieve(r.id)
    unstored = await client.responses.create(model="m", input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_previous_response_id_continues_from_the_stored_input_and_output(frontend_of, tokenizer):
    worker, make = frontend_of
    _, client_of = make()
    client = client_of()
    first = await client.responses.create(model="m", input="hi", instructions="be brief")
    second = await client.responses.create(model="m", input="again", previous_response_id=first.id)
    # instructions are not carried over (as OpenAI); the earlier turn is
    assert worker.seen[-1].token_ids == tokenizer.encode_chat([
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello world"},
        {"role": "user", "content": "again"}])
    assert second.previous_response_id == first.id
    third = await client.responses.create(model="m", input="more", previous_response_id=second.id)
    assert third.usage.input_tokens == len(tokenizer.encode_chat([
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello world"},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": " hello world"},
        {"role": "user", "content": "more"}]))
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="m", input="x", previous_response_id="resp_0123abcd")
    assert info.value.body["param"] == "previous_response_id" and "resp_0123abcd" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="x", previous_response_id=first.id, conversation="conv_1")
    assert info.value.body["param"] == "previous_response_id"


async def test_a_streamed_response_is_stored_before_its_last_event(frontend_of):
    _, make = frontend_of
    _, client_of = make()
    client = client_of()
    async with client.responses.stream(model="m", input="hi") as stream:
        async for event in stream:
            if event.type == "response.completed":
                # the client may ask for it as soon as it has this event
                assert (await client.responses.retrieve(event.response.id)).output_text == " hello world"
        final = await stream.get_final_response()
    assert final.store is True


async def test_one_api_keys_responses_and_conversations_are_not_found_for_another(frontend_of):
    _, make = frontend_of
    _, client_of = make(FrontendConfig(api_key="key-a,key-b"))
    a, b = client_of("key-a"), client_of("key-b")
    r = await a.responses.create(model="m", input="hi")
    conv = await a.conversations.create(items=[{"role": "user", "content": "hello"}])
    for call in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                 lambda: b.responses.create(model="m", input="x", previous_response_id=r.id),
                 lambda: b.conversations.retrieve(conv.id),
                 lambda: b.responses.create(model="m", input="x", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert (await a.responses.retrieve(r.id)).id == r.id
    with pytest.raises(openai.AuthenticationError):
        await client_of("key-c").responses.retrieve(r.id)


async def test_a_conversation_gathers_each_responses_input_and_output(frontend_of, tokenizer):
    worker, make = frontend_of
    _, client_of = make()
    client = client_of()
    conv = await client.conversations.create(items=[{"type": "message", "role": "system", "content": "be kind"}],
                                             metadata={"topic": "t"})
    assert conv.metadata == {"topic": "t"}
    await client.responses.create(model="m", input="hi", conversation=conv.id)
    r = await client.responses.create(model="m", input="again", conversation={"id": conv.id})
    assert r.conversation.id == conv.id
    assert worker.seen[-1].token_ids == tokenizer.encode_chat([
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " hello world"}, {"role": "user", "content": "again"}])
    items = await client.conversations.items.list(conv.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 5
    added = await client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user",
                                                                      "content": "p.s."}])
    item_id = added.data[0].id
    assert (await client.conversations.items.retrieve(item_id, conversation_id=conv.id)).id == item_id
    await client.conversations.items.delete(item_id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(item_id, conversation_id=conv.id)
    page = await client.conversations.items.list(conv.id, limit=2)
    assert len(page.data) == 2 and page.has_more
    updated = await client.conversations.update(conv.id, metadata={"topic": "u"})
    assert updated.metadata == {"topic": "u"}
    with pytest.raises(openai.BadRequestError) as info:
        await client.conversations.items.create(conv.id, items=[{"type": "computer_call"}])
    assert info.value.body["param"] == "items[0].type"
    await client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="m", input="x", conversation=conv.id)


async def test_a_background_response_is_polled_to_completion_and_can_be_cancelled(frontend_of):
    worker, make = frontend_of
    _, client_of = make()
    client = client_of()
    r = await client.responses.create(model="m", input="hi", background=True)
    assert r.status == "queued" and r.background is True
    for _ in range(100):
        r = await client.responses.retrieve(r.id)
        if r.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.05)
    assert r.status == "completed" and r.output_text == " hello world"
    worker.delay = 30  # a long one, cancelled
    slow = await client.responses.create(model="m", input="hi", background=True)
    cancelled = await client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(slow.id)).status == "cancelled"
    worker.delay = 0
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.cancel((await client.responses.create(model="m", input="hi")).id)
    assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="hi", background=True, store=False)
    assert info.value.body["param"] == "background"


async def test_with_the_store_off_state_is_refused_and_nothing_is_kept(frontend_of):
    _, make = frontend_of
    _, client_of = make(FrontendConfig(store=StoreConfig(kind="off")))
    client = client_of()
    r = await client.responses.create(model="m", input="hi")
    assert r.store is False
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="hi", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


async def test_an_unreachable_shared_store_is_a_503_never_an_empty_context(frontend_of):
    worker, make = frontend_of
    _, client_of = make(FrontendConfig(store=StoreConfig(kind="nats", nats_url=f"nats://127.0.0.1:{free_port()}")))
    client = client_of()
    seen = len(worker.seen)
    for call in (lambda: client.responses.create(model="m", input="x", previous_response_id="resp_0123abcd"),
                 lambda: client.responses.retrieve("resp_0123abcd"),
                 lambda: client.conversations.create()):
        with pytest.raises(openai.InternalServerError) as info:
            await call()
        assert info.value.status_code == 503 and "response store is unavailable" in info.value.body["message"]
    assert len(worker.seen) == seen  # nothing was generated without its context
    with pytest.raises(openai.InternalServerError) as info:  # stored by default: it cannot be kept, so 503
        await client.responses.create(model="m", input="x")
    assert info.value.status_code == 503
    assert (await client.responses.create(model="m", input="x", store=False)).output_text == " hello world"


async def test_a_cancel_reaching_another_frontend_process_marks_the_record_and_the_runner_stops(frontend_of):
    """Two frontends sharing one store (as processes share NATS): the run is on A, the cancel reaches B."""
    worker, make = frontend_of
    a, client_of_a = make()
    b, client_of_b = make()
    b.records = a.records  # one store for both (rebuild b's routes over it)
    from turbine.frontend.http.api import HttpApi

    app_b = HttpApi(b).app()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app_b), base_url="http://frontend")
    on_b = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="k", http_client=http, max_retries=0)
    worker.delay = 30
    slow = await client_of_a().responses.create(model="m", input="hi", background=True)
    assert slow.id in a.background.tasks and not b.background.tasks
    cancelled = await on_b.responses.cancel(slow.id)
    assert cancelled.status == "cancelled" and slow.id not in a.background.tasks
    worker.delay = 0


async def test_an_input_too_big_to_store_is_a_413_before_any_generation(frontend_of):
    worker, make = frontend_of
    _, client_of = make(FrontendConfig(store=StoreConfig(max_record_bytes=4096)))
    client = client_of()
    seen = len(worker.seen)
    with pytest.raises(openai.APIStatusError) as info:
        await client.responses.create(model="m", input="word " * 2000)
    assert info.value.status_code == 413 and info.value.body["param"] == "store"
    assert len(worker.seen) == seen
    assert (await client.responses.create(model="m", input="word " * 2000, store=False)).output_text
