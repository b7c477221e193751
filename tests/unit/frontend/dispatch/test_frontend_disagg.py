"""The frontend's half of disaggregated serving, with real request-plane servers standing in
for prefill and decode workers: when it prefills remotely, what it hands to decode, retries
and fallbacks, and how discovery turns it on and off."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from tests.unit.frontend.dispatch.test_dispatch import Run, closed_port_address
from turbine.frontend.dispatch.disagg import DisaggConfig, wants_remote_prefill
from turbine.frontend.errors import RequestError
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.models.decode_cache import DecodeCaches
from turbine.frontend.models.table import ModelTable, ServedModel
from turbine.protocol import errors as codes
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateOutput, GenerateRequest, SamplingOptions, StopConditions, Usage
from turbine.router.policy import RoundRobinRouter
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer

KV = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1]]}


def card(iid: str, mode: str = "agg", block_size: int = 128) -> ModelCard:
    return ModelCard(name="m", namespace="ns", component="prefill" if mode == "prefill" else "backend",
                     endpoint="generate", instance_id=iid, tokenizer_path="", context_length=2048,
                     kv_block_size=block_size, total_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=64,
                     disaggregation_mode=mode)


def record(c: ModelCard, address: str = "127.0.0.1:1") -> InstanceRecord:
    return InstanceRecord(namespace=c.namespace, component=c.component, endpoint=c.endpoint,
                          instance_id=c.instance_id, address=address)


class Workers:
    """Prefill and decode servers that log what they were asked."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefill_calls: list[GenerateRequest] = []
        self.decode_calls: list[GenerateRequest] = []
        self.servers: list[RequestPlaneServer] = []

    async def serve(self, handler) -> str:
        server = RequestPlaneServer()
        server.register("generate", GenerateRequest, handler)
        await server.start()
        self.servers.append(server)
        return server.address

    async def prefill(self, req, ctx):
        self.prefill_calls.append(req)
        yield GenerateOutput(token_ids=[5], finish_reason="length", kv_transfer_params=KV,
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=1, cached_tokens=128))

    async def failing_prefill(self, req, ctx):
        self.prefill_calls.append(req)
        raise RequestFailed("engine is dead", code=codes.ENGINE_FAILURE)
        yield

    async def decode(self, req, ctx):
        self.decode_calls.append(req)
        text = self.tokenizer.encode(" done", add_special_tokens=False)
        yield GenerateOutput(token_ids=text, finish_reason="length",
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(text)))

    async def stop(self):
        for s in self.servers:
            await s.stop()


def model_with(tokenizer, decode_address: str, prefill_addresses: list[str]) -> ServedModel:
    d = card("d")
    model = ServedModel("m", d, tokenizer, RoundRobinRouter(), [record(d, decode_address)], {"d": d},
                        prefill_router=RoundRobinRouter() if prefill_addresses else None)
    for i, address in enumerate(prefill_addresses):
        p = card(f"p{i}", "prefill")
        model.prefill_instances.append(record(p, address))
        model.prefill_cards[p.instance_id] = p
    return model


async def run(model, req, cfg=DisaggConfig(max_local_prefill_length=4)) -> tuple[str, Run, FrontendMetrics]:
    metrics = FrontendMetrics()
    client = RequestPlaneClient(connect_timeout=1.0)
    run = Run(model, client, req, metrics, cfg)
    try:
        text = await run.text()
    finally:
        await client.close()
    return text, run, metrics


def req(n_tokens: int = 10, n: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=list(range(1, n_tokens + 1)),
                           sampling=SamplingOptions(n=n), stop=StopConditions(max_tokens=20))


async def test_prefill_then_decode_with_the_kv_location(tokenizer):
    w = Workers(tokenizer)
    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(w.prefill)])
        text, pipeline, _ = await run(model, req())
        assert text == " done"
        (p,) = w.prefill_calls
        assert p.stop.max_tokens == 1 and p.token_ids == req().token_ids
        (d,) = w.decode_calls
        assert d.kv_transfer_params == KV and d.stop.max_tokens == 20  # the original max_tokens
        assert pipeline.usage.cached_tokens == 128  # what the prefill worker found cached
    finally:
        await w.stop()


async def test_short_prompts_and_n_above_one_prefill_on_the_decode_worker(tokenizer):
    w = Workers(tokenizer)
    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(w.prefill)])
        await run(model, req(n_tokens=3))  # below --max-local-prefill-length 4
        assert not w.prefill_calls and w.decode_calls[-1].kv_transfer_params is None
        cfg = DisaggConfig(max_local_prefill_length=0)
        assert not wants_remote_prefill(model, req(n=2), cfg)
        assert wants_remote_prefill(model, req(), cfg)
        model.prefill_queued_tokens = {"p0": 4 * 64}  # four steps' worth queued on the only prefill worker
        assert not wants_remote_prefill(model, req(), cfg)
    finally:
        await w.stop()


async def test_prompt_mostly_cached_on_the_decode_worker_is_prefilled_there(tokenizer):
    """The length that counts is the part the decode worker would compute: a follow-up turn of
    a conversation it just served is prefilled there; a new long prompt is handed over."""
    w = Workers(tokenizer)
    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(w.prefill)])
        model.decode_caches = DecodeCaches(block_size=4)
        cfg = DisaggConfig(max_local_prefill_length=8)
        turn1 = list(range(100, 112))  # 12 tokens: 3 blocks of 4, nothing cached
        await run(model, GenerateRequest(request_id="t1", model="m", token_ids=turn1), cfg)
        assert len(w.prefill_calls) == 1 and w.decode_calls[-1].kv_transfer_params == KV
        assert model.decode_caches.cached_tokens("d", turn1) == 12  # the decode worker holds it now
        turn2 = turn1 + [7, 8, 9, 10, 11]  # 17 tokens, 5 of them new: under 8 to compute
        await run(model, GenerateRequest(request_id="t2", model="m", token_ids=turn2), cfg)
        assert len(w.prefill_calls) == 1 and w.decode_calls[-1].kv_transfer_params is None
        other = list(range(500, 517))  # 17 tokens, none cached
        await run(model, GenerateRequest(request_id="t3", model="m", token_ids=other), cfg)
        assert len(w.prefill_calls) == 2 and w.decode_calls[-1].kv_transfer_params == KV
    finally:
        await w.stop()


def test_decode_caches_forget_workers_that_left_and_expire():
    now = [0.0]
    caches = DecodeCaches(block_size=4, ttl_s=10, clock=lambda: now[0])
    prompt = list(range(10))  # two full blocks
    assert caches.cached_tokens("d", prompt) == 0
    caches.served("d", prompt)
    caches.served("e", prompt[:4])
    assert (caches.cached_tokens("d", prompt), caches.cached_tokens("e", prompt)) == (8, 4)
    caches.keep_only({"e"})
    assert (caches.cached_tokens("d", prompt), caches.cached_tokens("e", prompt)) == (0, 4)
    now[0] = 11.0
    assert caches.cached_tokens("e", prompt) == 0


async def test_failed_prefill_worker_is_skipped_then_local_prefill(tokenizer):
    w = Workers(tokenizer)
    try:
        good = await w.serve(w.prefill)
        bad = await w.serve(w.failing_prefill)
        model = model_with(tokenizer, await w.serve(w.decode), [bad, closed_port_address(), good])
        for _ in range(3):  # whichever the round-robin tries first, the good one serves the KV
            text, _, _ = await run(model, req())
            assert text == " done" and w.decode_calls[-1].kv_transfer_params == KV
        model = model_with(tokenizer, model.instances[0].address, [bad, closed_port_address()])
        text, _, metrics = await run(model, req())
        assert text == " done" and w.decode_calls[-1].kv_transfer_params is None  # computed on decode
        assert metrics.of("m").local_prefills._value.get() == 1
    finally:
        await w.stop()


async def test_hung_prefill_worker_times_out(tokenizer):
    w = Workers(tokenizer)

    async def hung(req, ctx):
        await asyncio.Event().wait()
        yield GenerateOutput(token_ids=[])

    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(hung)])
        cfg = DisaggConfig(max_local_prefill_length=0, prefill_timeout_s=0.3)
        text, _, _ = await asyncio.wait_for(run(model, req(), cfg), 10)
        assert text == " done" and w.decode_calls[-1].kv_transfer_params is None
    finally:
        await w.stop()


async def test_invalid_request_from_the_prefill_worker_is_the_clients_error(tokenizer):
    w = Workers(tokenizer)

    async def refuses(req, ctx):
        raise InvalidRequest("token id out of vocabulary")
        yield

    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(refuses)])
        with pytest.raises(RequestError, match="out of vocabulary"):
            await run(model, req())
        assert not w.decode_calls
    finally:
        await w.stop()


class Registry:
    def __init__(self):
        self.snapshots = asyncio.Queue()

    async def watch(self):
        while True:
            yield await self.snapshots.get()


async def test_discovery_turns_disaggregation_on_and_off(tokenizer, monkeypatch):
    table = ModelTable(Registry(), lambda c: RoundRobinRouter())

    async def fake_tokenizer(c):
        return tokenizer

    monkeypatch.setattr(table, "_tokenizer", fake_tokenizer)
    d, p, odd = card("d"), card("p", "prefill"), card("q", "prefill", block_size=16)
    await table._apply([record(p)], [p])
    assert "m" not in table.models  # prefill workers alone serve nothing
    await table._apply([record(d), record(p), record(odd)], [d, p, odd])
    m = table.models["m"]
    assert [i.instance_id for i in m.instances] == ["d"]
    assert [i.instance_id for i in m.prefill_instances] == ["p"]  # the other block size cannot hand KV over
    assert m.decode_caches is not None and m.decode_caches.block_size == 128
    m.decode_caches.served("d", list(range(256)))
    await table._apply([record(d), record(p)], [d, p])
    assert table.models["m"].decode_caches.cached_tokens("d", list(range(300))) == 256  # kept across snapshots
    await table._apply([record(d)], [d])
    assert not table.models["m"].prefill_instances  # back to aggregated
    assert table.models["m"].decode_caches is None


def adapter(c: ModelCard, name: str) -> ModelCard:
    return msgspec.structs.replace(c, name=name, lora_name=name, lora_id=1, base_model=c.name)


async def test_adapters_are_models_of_their_holders(tokenizer, monkeypatch):
    """An adapter's cards make it a model: parent = base, only the instances holding it, the
    base's router; its prefill workers are those holding it, else it is served aggregated."""
    table = ModelTable(Registry(), lambda c: RoundRobinRouter())

    async def fake_tokenizer(c):
        return tokenizer

    monkeypatch.setattr(table, "_tokenizer", fake_tokenizer)
    d1, d2, p = card("d1"), card("d2"), card("p", "prefill")
    cards = [d1, d2, p, adapter(d1, "sql"), adapter(d2, "m")]  # an adapter named as the base model: skipped
    await table._apply([record(c) for c in (d1, d2, p)], cards)
    base, sql = table.models["m"], table.models["sql"]
    assert (sql.parent, sql.lora_name, base.parent) == ("m", "sql", None)
    assert [i.instance_id for i in sql.instances] == ["d1"] and len(base.instances) == 2
    assert sql.router is base.router and sql.tokenizer is base.tokenizer
    assert sql.prefill_instances == [] and sql.lora_fallback  # no prefill worker holds it
    await table._apply([record(c) for c in (d1, d2, p)], [*cards, adapter(p, "sql")])
    sql = table.models["sql"]
    assert [i.instance_id for i in sql.prefill_instances] == ["p"] and not sql.lora_fallback
    assert sql.decode_caches is not None and sql.decode_caches is not table.models["m"].decode_caches
    await table._apply([record(c) for c in (d2, p)], [*cards, adapter(p, "sql")])  # its holder left
    assert "sql" not in table.models
    # the adapter's request carries its name
    from turbine.frontend.preprocess.stage import preprocess
    await table._apply([record(c) for c in (d1, d2)], [d1, d2, adapter(d1, "sql")])
    prepared = await preprocess(b'{"model": "sql", "prompt": "hi", "max_tokens": 2}', "completions", table)
    assert prepared.request.lora_name == "sql" and prepared.request.model == "sql"


async def test_workers_with_different_migration_limits_are_named_once(tokenizer, monkeypatch, caplog):
    """The model takes its first card's limit (lowest instance id); workers that disagree are named,
    once per change of what they say, not on every discovery snapshot."""
    table = ModelTable(Registry(), lambda c: RoundRobinRouter())

    async def fake_tokenizer(c):
        return tokenizer

    monkeypatch.setattr(table, "_tokenizer", fake_tokenizer)
    a, b = msgspec.structs.replace(card("a"), migration_limit=3), card("b")
    with caplog.at_level(logging.WARNING, logger="turbine.frontend"):
        await table._apply([record(a)], [a])
        assert not caplog.records
        for _ in range(2):
            await table._apply([record(a), record(b)], [a, b])
    warned = [r.getMessage() for r in caplog.records if "--migration-limit" in r.getMessage()]
    assert len(warned) == 1 and "a: 3, b: 0" in warned[0] and "uses 3, worker a's" in warned[0]
    assert table.models["m"].card.migration_limit == 3
