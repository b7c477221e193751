"""The frontend's worker call without an engine: unreachable instances are skipped, and
when none is left the request gets 503; a real request-plane server stands in for a worker."""

from __future__ import annotations

import asyncio
import socket

import pytest

from turbine.frontend.generation import Generation
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.models import ServedModel
from turbine.frontend.openai_schemas import RequestError
from turbine.router.policy import RandomRouter, RoundRobinRouter, RouterConfig, make_router
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateOutput, GenerateRequest, OutputOptions, StopConditions, Usage
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


def request() -> GenerateRequest:
    return GenerateRequest(request_id="r1", model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2))


async def test_no_reachable_worker_is_503(tokenizer):
    model = served(tokenizer, [instance("a", closed_port_address()), instance("b", closed_port_address())])
    client = RequestPlaneClient(connect_timeout=1.0)
    gen = Generation(model, client, request(), stop=[], include_stop_str_in_output=False,
                     skip_special_tokens=True, metrics=FrontendMetrics().of("m"))
    with pytest.raises(RequestError) as info:
        async for _ in gen.events():
            pass
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
            gen = Generation(model, client, request(), stop=[], include_stop_str_in_output=False,
                             skip_special_tokens=True, metrics=FrontendMetrics().of("m"))
            text = "".join([d.text async for d in gen.events()])
            assert text == "Hello"
            assert gen.usage.completion_tokens == len(hello)
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
            gen = Generation(model, client, req, stop=[], include_stop_str_in_output=False,
                             skip_special_tokens=True, metrics=FrontendMetrics().of("m"))
            events = gen.events()
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
