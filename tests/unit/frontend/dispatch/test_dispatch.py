"""The dispatch stage (and postprocess behind it) without an engine: unreachable instances are
skipped, when none is left the request gets 503, worker errors arrive typed, outputs that
arrive together are merged; a real request-plane server stands in for a worker."""

from __future__ import annotations

import asyncio
import socket

import pytest

from turbine.frontend.deltas import OutputSpec
from turbine.frontend.dispatch.disagg import DisaggConfig
from turbine.frontend.dispatch.migration import MigrationConfig
from turbine.frontend.errors import Overloaded, RequestError, WorkerFailed
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.models.table import ServedModel
from turbine.frontend.pipeline import Pipeline
from turbine.frontend.preprocess.stage import Prepared
from turbine.protocol import errors as codes
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateOutput, GenerateRequest, OutputOptions, StopConditions, Usage
from turbine.router.policy import RandomRouter, RoundRobinRouter, RouterConfig, make_router
from turbine.runtime.errors import AdapterNotLoaded, InvalidRequest, RequestFailed
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer


def closed_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes


def instance(iid: str, address: str) -> InstanceRecord:
    return InstanceRecord(namespace="ns", component="backend", endpoint="generate", instance_id=iid,
                          address=address)


def served(tokenizer, instances) -> ServedModel:
    card = ModelCard(name="m", namespace="ns", component="backend", endpoint="generate", instance_id="x",
                     tokenizer_path="", context_length=2048, kv_block_size=128, total_kv_blocks=10,
                     max_num_seqs=4, max_num_batched_tokens=2048)
    return ServedModel("m", card, tokenizer, RoundRobinRouter(), list(instances))


class Run(Pipeline):
    """The stages after preprocess, as the http stage runs them."""

    def __init__(self, model, client, req, metrics=None, disagg=DisaggConfig(), migration=MigrationConfig()):
        spec = OutputSpec(stop=[], include_stop_str_in_output=False, skip_special_tokens=True)
        prepared = Prepared("completions", model, req, spec, stream=True, include_usage=False)
        super().__init__(prepared, client, (metrics or FrontendMetrics()).of("m"), disagg, migration)

    async def text(self) -> str:
        return "".join([d.text async for d in self.deltas])


def request() -> GenerateRequest:
    return GenerateRequest(request_id="r1", model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2))


async def test_no_reachable_worker_is_503(tokenizer):
    model = served(tokenizer, [instance("a", closed_port_address()), instance("b", closed_port_address())])
    client = RequestPlaneClient(connect_timeout=1.0)
    with pytest.raises(RequestError) as info:
        await Run(model, client, request()).text()
    assert info.value.status == 503
    await client.close()


async def test_unreachable_instance_is_skipped(tokenizer):
    hello = tokenizer.encode("Hello", add_special_tokens=False)

    async def generate(req, ctx):
        yield GenerateOutput(token_ids=hello, finish_reason="stop",
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(hello)))

    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, generate)
    await server.start()
    model = served(tokenizer, [instance("dead", closed_port_address()), instance("live", server.address)])
    client = RequestPlaneClient(connect_timeout=1.0)
    try:
        for _ in range(2):  # whichever the round-robin picks first, the request succeeds
            run = Run(model, client, request())
            assert await run.text() == "Hello"
            assert run.usage.completion_tokens == len(hello)
    finally:
        await client.close()
        await server.stop()


async def test_outputs_that_arrive_together_are_merged(tokenizer):
    """A burst of one-token outputs becomes fewer deltas with the same text; with logprobs
    every token keeps its own delta."""
    words = tokenizer.encode(" one two three four five six", add_special_tokens=False)
    burst = asyncio.Event()

    async def generate(req, ctx):
        await burst.wait()  # all outputs are sent in one go, before the reader looks
        for i, t in enumerate(words):
            last = i == len(words) - 1
            yield GenerateOutput(token_ids=[t], finish_reason="length" if last else None,
                                 log_probs=[-0.5] if req.output.logprobs is not None else None,
                                 usage=Usage(prompt_tokens=3, completion_tokens=len(words)) if last else None)

    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, generate)
    await server.start()
    model = served(tokenizer, [instance("live", server.address)])
    client = RequestPlaneClient(connect_timeout=1.0)
    try:
        for logprobs in (None, 0):
            burst.clear()
            req = GenerateRequest(request_id=f"r-{logprobs}", model="m", token_ids=[1, 2, 3],
                                  stop=StopConditions(max_tokens=len(words)), output=OutputOptions(logprobs=logprobs))
            events = Run(model, client, req).deltas
            asyncio.get_running_loop().call_later(0.2, burst.set)
            deltas = [d async for d in events]
            assert "".join(d.text for d in deltas) == " one two three four five six"
            assert deltas[-1].finish_reason == "length"
            if logprobs is None:
                assert len(deltas) < len(words)
            else:
                assert len(deltas) == len(words)
    finally:
        await client.close()
        await server.stop()


def test_routers(tokenizer):
    insts = [instance(str(i), f"h:{i}") for i in range(3)]
    card = served(tokenizer, insts).card
    rr = make_router(RouterConfig(mode="round-robin"), card)
    assert [rr.select(insts, request()).instance.instance_id for _ in range(6)] == ["0", "1", "2", "0", "1", "2"]
    rnd = make_router(RouterConfig(mode="random"), card)
    assert isinstance(rnd, RandomRouter)
    assert {rnd.select(insts, request()).instance.instance_id for _ in range(200)} == {"0", "1", "2"}
    with pytest.raises(ValueError, match="--router-mode"):
        make_router(RouterConfig(mode="nope"), card)


async def test_worker_errors_arrive_typed(tokenizer):
    """A worker's typed error becomes the frontend's by its code (never by its message): bad
    input is the client's 400, a draining or overloaded worker 503, an engine failure 502."""
    failure = {}

    async def generate(req, ctx):
        yield GenerateOutput(token_ids=[])
        raise failure["exc"]

    async def refuse_at_once(req, ctx):
        raise failure["exc"]
        yield

    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, refuse_at_once)
    server.register("midway", GenerateRequest, generate)
    await server.start()
    model = served(tokenizer, [instance("live", server.address)])
    client = RequestPlaneClient(connect_timeout=1.0)
    cases = [(InvalidRequest("bad token"), RequestError, 400, "invalid_request_error"),
             (RequestFailed("draining", code=codes.SHUTTING_DOWN), WorkerFailed, 503, "service_unavailable"),
             (RequestFailed("full", code=codes.OVERLOADED), WorkerFailed, 503, "service_unavailable"),
             (RequestFailed("engine died", code=codes.ENGINE_FAILURE), WorkerFailed, 502, "worker_error"),
             (ValueError("a bug"), WorkerFailed, 502, "worker_error")]
    try:
        for endpoint in ("generate", "midway"):
            model.instances[0] = InstanceRecord(namespace="ns", component="backend", endpoint=endpoint,
                                                instance_id="live", address=server.address)
            for exc, kind, status, type_ in cases:
                failure["exc"] = exc
                with pytest.raises(RequestError) as info:
                    await Run(model, client, request()).text()
                if endpoint == "generate" and getattr(exc, "code", None) == codes.OVERLOADED:
                    kind = Overloaded  # refused before the first token by every worker (here: the only one)
                assert type(info.value) is kind and (info.value.status, info.value.type) == (status, type_), exc
    finally:
        await client.close()
        await server.stop()


async def test_an_undecodable_worker_output_is_a_502_not_a_crash(tokenizer):
    """A worker whose chunk is not a GenerateOutput (a bug, another wire version) fails the request
    as the worker's error, before or after the first output, and never escapes as a 500."""

    class Wrong(GenerateOutput, kw_only=True):
        token_ids: str = "not a list"  # type: ignore[assignment]

    async def wrong_at_once(req, ctx):
        yield Wrong()

    async def wrong_midway(req, ctx):
        yield GenerateOutput(token_ids=[tokenizer.encode("Hi", add_special_tokens=False)[0]])
        yield Wrong()

    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, wrong_at_once)
    server.register("midway", GenerateRequest, wrong_midway)
    await server.start()
    model = served(tokenizer, [instance("live", server.address)])
    client = RequestPlaneClient(connect_timeout=1.0)
    try:
        for endpoint in ("generate", "midway"):
            model.instances[0] = InstanceRecord(namespace="ns", component="backend", endpoint=endpoint,
                                                instance_id="live", address=server.address)
            with pytest.raises(WorkerFailed) as info:
                await Run(model, client, request(), migration=MigrationConfig(limit=3)).text()
            assert info.value.status == 502 and "undecodable" in info.value.message, endpoint
    finally:
        await client.close()
        await server.stop()


async def test_a_worker_without_the_adapter_sends_the_request_to_one_that_holds_it(tokenizer):
    """An adapter unloaded after the frontend's last look at discovery: the worker refuses with
    ADAPTER_NOT_LOADED before any work, the request goes to a worker that still holds it (no
    migration needed); when none does, the client gets 404 model_not_found, not a 400 or 502."""
    hello = tokenizer.encode("Hello", add_special_tokens=False)

    async def without_it(req, ctx):
        raise AdapterNotLoaded(req.lora_name)
        yield

    async def with_it(req, ctx):
        yield GenerateOutput(token_ids=hello, finish_reason="stop",
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(hello)))

    servers = [RequestPlaneServer(), RequestPlaneServer()]
    servers[0].register("generate", GenerateRequest, without_it)
    servers[1].register("generate", GenerateRequest, with_it)
    for s in servers:
        await s.start()
    client = RequestPlaneClient(connect_timeout=1.0)
    adapter_request = lambda: GenerateRequest(request_id="r1", model="m", token_ids=[1, 2, 3], lora_name="sql",  # noqa: E731
                                              stop=StopConditions(max_tokens=2))
    try:
        model = served(tokenizer, [instance("gone", servers[0].address), instance("holds", servers[1].address)])
        for _ in range(2):  # whichever the round-robin picks first
            assert await Run(model, client, adapter_request(), migration=MigrationConfig(limit=0)).text() == "Hello"
        model = served(tokenizer, [instance("gone", servers[0].address)])
        with pytest.raises(RequestError) as info:
            await Run(model, client, adapter_request()).text()
        assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")
    finally:
        await client.close()
        for s in servers:
            await s.stop()
