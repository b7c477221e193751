"""The vLLM worker's text mode (--use-vllm-tokenizer), on an engine stand-in; the real engine
path (vLLM's chat template, detokenization, stop strings) is tests/integration/test_text_mode.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.unit.vllm.test_vllm_disagg_handlers import Engine
from turbine.protocol.generate import GenerateRequest, OutputOptions, StopConditions, TextInput
from turbine.runtime.errors import InvalidRequest
from turbine.vllm.args import parse_worker_args
from turbine.vllm.handlers import AggregatedHandlers
from turbine.worker.worker_metrics import WorkerMetrics


class TextEngine(Engine):
    """Tokenizes by characters and answers with text deltas."""

    def __init__(self):
        super().__init__()
        self.prompts: list = []
        self.params: list = []
        self.renderer = SimpleNamespace(render_messages_async=self.render)

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text, add_special_tokens: [ord(c) for c in text])

    async def render(self, messages, params):
        self.rendered = params.chat_template_kwargs
        self.template = params.chat_template
        return messages, {"prompt_token_ids": [1] * len(messages[0]["content"])}

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        self.prompts.append(prompt["prompt_token_ids"])
        self.params.append(params)
        for text, fin in (("Hel", None), ("lo", "stop")):
            comp = SimpleNamespace(index=0, token_ids=[7], text=text, logprobs=None, finish_reason=fin,
                                   stop_reason="." if fin else None)
            yield SimpleNamespace(outputs=[comp], finished=fin is not None, num_cached_tokens=0)


def handlers(text_mode=True, chat_template=None):
    engine = TextEngine()
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": "w"})
    return AggregatedHandlers(engine, metrics, text_mode=text_mode, chat_template=chat_template), engine


async def collect(h, req):
    return [o async for o in h.generate(req, None)]


async def test_completion_text_is_tokenized_here_and_text_streams_back():
    h, engine = handlers()
    req = GenerateRequest(request_id="r", model="m", token_ids=[],
                          text=TextInput(prompt="abc", stop=["."], include_stop_str_in_output=True))
    outs = await collect(h, req)
    assert engine.prompts == [[97, 98, 99]]
    params = engine.params[0]
    assert params.detokenize and params.stop == ["."] and params.include_stop_str_in_output
    assert [o.text for o in outs] == ["Hel", "lo"] and outs[-1].finish_reason == "stop"
    assert (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens) == (3, 2)


async def test_chat_is_rendered_by_the_engines_renderer_with_the_template_arguments():
    h, engine = handlers(chat_template="{{ messages }}")  # --custom-jinja-template's text
    msgs = [{"role": "user", "content": "hello"}]
    req = GenerateRequest(request_id="r", model="m", token_ids=[],
                          text=TextInput(messages=msgs, tools=[{"type": "function"}], add_generation_prompt=False,
                                         chat_template_kwargs={"enable_thinking": True}))
    await collect(h, req)
    assert engine.prompts == [[1] * 5]
    assert engine.rendered == {"enable_thinking": True, "add_generation_prompt": False,
                               "tools": [{"type": "function"}], "tokenize": True}
    assert engine.template == "{{ messages }}"


@pytest.mark.parametrize("req,words", [
    (GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a" * 512)), "context length"),
    (GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a" * 500),
                     stop=StopConditions(max_tokens=20)), "context length"),
    (GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a"),
                     output=OutputOptions(logprobs=1)), "logprobs"),
    (GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a", messages=[])), "not both"),
    (GenerateRequest(request_id="r", model="m", token_ids=[1], text=TextInput(prompt="a")), "both given"),
    (GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput()), "empty"),
    (GenerateRequest(request_id="r", model="m", token_ids=[1, 2]), "text mode"),
])
async def test_bad_text_requests_are_invalid(req, words):
    h, engine = handlers()  # context length 512
    with pytest.raises(InvalidRequest, match=words):
        await asyncio.wait_for(collect(h, req), 10)
    assert engine.prompts == []


async def test_a_token_mode_worker_refuses_text():
    h, _ = handlers(text_mode=False)
    with pytest.raises(InvalidRequest, match="use-vllm-tokenizer"):
        await collect(h, GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a")))


def test_the_flag_sets_the_card_and_refuses_disaggregation(capsys):
    cfg = parse_worker_args(["--use-vllm-tokenizer"])
    assert cfg.use_vllm_tokenizer and not parse_worker_args([]).use_vllm_tokenizer
    card = cfg.model_card("i", engine="vllm", tokenizer_path="", context_length=1, kv_block_size=1,
                          total_kv_blocks=1, max_num_seqs=1, max_num_batched_tokens=1,
                          model_input="text" if cfg.use_vllm_tokenizer else "tokens")
    assert card.model_input == "text"
    with pytest.raises(SystemExit):
        parse_worker_args(["--use-vllm-tokenizer", "--is-prefill-worker", "--connector", "nixl"])
    assert "--use-vllm-tokenizer" in capsys.readouterr().err


async def test_a_token_id_prompt_goes_to_the_engine_as_it_is_and_text_comes_back():
    h, engine = handlers()
    outs = await collect(h, GenerateRequest(request_id="r", model="m", token_ids=[4, 5], text=TextInput()))
    assert engine.prompts == [[4, 5]] and engine.params[0].detokenize
    assert "".join(o.text for o in outs) == "Hello"
