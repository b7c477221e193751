"""Text mode in the frontend (models whose workers run with --use-vllm-tokenizer): no tokenizer
is loaded, requests go out as text, the worker's text passes through, KV routing works on load."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from tests.unit.frontend.dispatch.test_dispatch import instance
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable, ServedModel
from turbine.frontend.postprocess.stage import TextPostprocess
from turbine.frontend.preprocess.stage import preprocess
from turbine.frontend.preprocess.text_mode import refuse_in_text_mode
from turbine.protocol.discovery import ModelCard
from turbine.protocol.generate import GenerateOutput, GenerateRequest, TextInput, Usage
from turbine.router.metrics import RouterMetrics
from turbine.router.policy import RoundRobinRouter, RouterConfig, make_router


def text_card(instance_id: str = "x", model_input: str = "text") -> ModelCard:
    return ModelCard(name="m", namespace="ns", component="backend", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="/no/such/tokenizer", context_length=2048, kv_block_size=16,
                     total_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=2048, model_input=model_input)


@pytest.fixture
def models() -> ModelTable:
    table = ModelTable(registry=None, make_router=None)
    table.models["m"] = ServedModel("m", text_card(), None, RoundRobinRouter(), [instance("w", "127.0.0.1:1")])
    return table


def body(**fields) -> bytes:
    return msgspec.json.encode(fields)


MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


async def test_chat_goes_out_as_messages_with_their_template_arguments(models):
    p = await preprocess(body(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                              chat_template_kwargs={"enable_thinking": False},
                              add_generation_prompt=False, stop=["END"], include_stop_str_in_output=True,
                              max_completion_tokens=7, n=2), "chat", models)
    assert p.request.token_ids == []
    assert p.request.text == TextInput(messages=MESSAGES, tools=TOOLS, chat_template_kwargs={"enable_thinking": False},
                                       add_generation_prompt=False, stop=["END"], include_stop_str_in_output=True)
    assert (p.request.stop.max_tokens, p.request.sampling.n) == (7, 2)
    # The contract round-trips (what the worker decodes).
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(p.request), type=GenerateRequest)
    assert wire.text == p.request.text


async def test_completion_prompt_text_and_unset_max_tokens_left_to_the_worker(models):
    p = await preprocess(body(model="m", prompt="Once upon", stop="."), "completions", models)
    assert p.request.text == TextInput(prompt="Once upon", stop=["."])
    assert p.request.stop.max_tokens is None  # the worker knows the prompt's length; it fills in the rest


@pytest.mark.parametrize("kind,fields,param", [
    ("completions", dict(prompt="hi", logprobs=2), "logprobs"),
    ("completions", dict(prompt="hi", logprobs=0), "logprobs"),
    ("completions", dict(prompt="", prompt_embeds="UEsDBA=="), "prompt_embeds"),
    ("chat", dict(messages=MESSAGES, logprobs=True), "logprobs"),
    ("chat", dict(messages=MESSAGES, max_tokens=2, min_tokens=3), "min_tokens"),
])
async def test_what_needs_a_frontend_tokenizer_is_refused_by_name(models, kind, fields, param):
    with pytest.raises(RequestError) as info:
        await preprocess(body(model="m", **fields), kind, models)
    assert info.value.param == param and info.value.status == 400
    if param != "min_tokens":
        assert "text mode" in info.value.message


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}, "text mode"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "not supported"),
])
async def test_media_parts_are_refused_not_handed_to_the_worker(models, part, words):
    # The worker would give them to vLLM's renderer, which fetches URLs with none of the frontend's checks.
    with pytest.raises(RequestError) as info:
        await preprocess(body(model="m", messages=[{"role": "user", "content": [part]}]), "chat", models)
    assert info.value.param == "messages" and words in info.value.message


def test_refusal_for_tokenizer_endpoints_names_text_mode():
    err = refuse_in_text_mode("m", "/tokenize", param="model")
    assert (err.status, err.param) == (400, "model") and "text mode" in err.message and "/tokenize" in err.message


def test_postprocess_passes_the_workers_text_through_with_its_usage():
    post = TextPostprocess(n=1)
    first = post.apply(GenerateOutput(token_ids=[5, 6], text="Paris STOP"))  # no stop strings applied here
    last = post.apply(GenerateOutput(token_ids=[7], text=" is", finish_reason="stop",
                                     usage=Usage(prompt_tokens=11, completion_tokens=3, cached_tokens=4)))
    assert (first.text, first.finish_reason, last.text, last.finish_reason) == ("Paris STOP", None, " is", "stop")
    assert (post.usage.prompt_tokens, post.usage.completion_tokens, post.usage.cached_tokens) == (11, 3, 4)
    assert post.finished == [True] and post.apply(GenerateOutput(token_ids=[1], text="x")) is None


def test_postprocess_runs_the_parser_chain_on_text():
    class Upper:
        def push(self, delta):
            delta.text = delta.text.upper()
            return delta

        def finish(self, delta):
            delta.text += "!"
            return delta

    post = TextPostprocess(n=1, parsers=lambda: [Upper()])
    assert post.apply(GenerateOutput(token_ids=[1], text="ok", finish_reason="length")).text == "OK!"


async def test_the_model_table_loads_no_tokenizer_for_text_mode_and_skips_mixed_peers():
    table = ModelTable(registry=None, make_router=lambda card: RoundRobinRouter())
    cards = [text_card("a"), text_card("b", model_input="tokens")]  # b would need /no/such/tokenizer
    recs = [instance(c.instance_id, "127.0.0.1:1") for c in cards]
    for rec, card in zip(recs, cards):
        rec.namespace, rec.component, rec.endpoint = card.namespace, card.component, card.endpoint
    await table._apply(recs, cards)
    model = table.models["m"]
    assert model.tokenizer is None and [i.instance_id for i in model.instances] == ["a"]


async def test_kv_routing_falls_back_to_load_for_text_requests():
    router = make_router(RouterConfig(mode="kv"), text_card("a"), RouterMetrics(CollectorRegistry()))
    try:
        records = [instance("a", "127.0.0.1:1"), instance("b", "127.0.0.1:2")]
        for rec in records:
            rec.namespace = "ns"
        router.instances_changed(records, {"a": text_card("a"), "b": text_card("b")})
        req = GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="hi"))
        assert router.select(records, req).instance.instance_id in ("a", "b")
    finally:
        router.core.close()


async def test_a_prefill_worker_is_not_attached_to_a_text_mode_model():
    table = ModelTable(registry=None, make_router=lambda card: RoundRobinRouter())
    prefill = msgspec.structs.replace(text_card("p", model_input="tokens"), disaggregation_mode="prefill",
                                      component="prefill")
    cards = [text_card("a"), prefill]
    recs = [instance("a", "127.0.0.1:1"), instance("p", "127.0.0.1:2")]
    for rec, card in zip(recs, cards):
        rec.namespace, rec.component, rec.endpoint = card.namespace, card.component, card.endpoint
    await table._apply(recs, cards)
    assert table.models["m"].prefill_instances == [] and table.models["m"].prefill_router is None


async def test_a_token_id_prompt_goes_out_as_it_is(models):
    p = await preprocess(body(model="m", prompt=[1, 2, 3], max_tokens=4), "completions", models)
    assert (p.request.token_ids, p.request.text, p.request.stop.max_tokens) == ([1, 2, 3], TextInput(), 4)
