"""Request migration in the dispatch stage, with real request-plane servers standing in for
workers: a worker that fails mid-stream with a migratable error hands the request to another,
which gets the prompt plus the tokens so far; what cannot continue fails with its reason. The
end-to-end cases (killed and SIGTERMed mocker and vLLM workers) are in tests/integration."""

from __future__ import annotations

import pytest

from tests.unit.frontend.dispatch.test_dispatch import Run, instance, served
from turbine.frontend.args import parse_frontend_args
from turbine.frontend.dispatch.migration import MigrationConfig, continuation
from turbine.frontend.errors import WorkerFailed
from turbine.frontend.metrics import FrontendMetrics
from turbine.protocol import errors as codes
from turbine.protocol.generate import (
    GenerateOutput,
    GenerateRequest,
    OutputOptions,
    SamplingOptions,
    StopConditions,
    StructuredOutputs,
    Usage,
)
from turbine.runtime.errors import RequestFailed
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer

PROMPT = [1, 2, 3]


class Workers:
    """Two request-plane servers: `first` sends `sent` tokens then fails with `code` (None:
    at once, before any output); `second` records what it got and finishes the request."""

    def __init__(self, tokenizer, code: str, sent: int):
        self.words = tokenizer.encode(" one two three four five six", add_special_tokens=False)
        self.code, self.sent, self.received = code, sent, []

    async def failing(self, req, ctx):
        for t in self.words[:self.sent]:
            yield GenerateOutput(token_ids=[t])
        raise RequestFailed("going away", code=self.code)

    async def finishing(self, req, ctx):
        self.received.append(req)
        rest = self.words[len(req.token_ids) - len(PROMPT):]
        for i, t in enumerate(rest):
            last = i == len(rest) - 1
            yield GenerateOutput(token_ids=[t], finish_reason="length" if last else None,
                                 usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(rest),
                                             cached_tokens=len(req.token_ids)) if last else None)

    async def __aenter__(self):
        self.servers = []
        for handler in (self.failing, self.finishing):
            server = RequestPlaneServer()
            server.register("generate", GenerateRequest, handler)
            await server.start()
            self.servers.append(server)
        self.client = RequestPlaneClient(connect_timeout=1.0)
        return self

    def model(self, tokenizer, card_limit: int = 0):
        model = served(tokenizer, [instance("a", self.servers[0].address), instance("b", self.servers[1].address)])
        model.card.migration_limit = card_limit
        return model

    async def __aexit__(self, *exc):
        await self.client.close()
        for server in self.servers:
            await server.stop()


def req(**fields) -> GenerateRequest:
    fields.setdefault("stop", StopConditions(max_tokens=6))
    return GenerateRequest(request_id="r1", model="m", token_ids=list(PROMPT), **fields)


def migrations(metrics: FrontendMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("turbine_frontend_migrations_total", {"model": "m", "reason": reason}) or 0


@pytest.mark.parametrize("code", [codes.SHUTTING_DOWN, codes.OVERLOADED])
async def test_a_request_continues_on_another_worker_from_its_tokens(tokenizer, code):
    async with Workers(tokenizer, code, sent=2) as w:
        metrics = FrontendMetrics()
        run = Run(w.model(tokenizer, card_limit=1), w.client, req(stop=StopConditions(max_tokens=6, min_tokens=4)),
                  metrics)
        assert await run.text() == " one two three four five six"
        (got,) = w.received
        assert got.token_ids == PROMPT + w.words[:2]  # the prompt plus what was generated
        assert (got.stop.max_tokens, got.stop.min_tokens) == (4, 2)
        assert got.request_id == "r1-m1" and got.kv_transfer_params is None
        # Usage counts the client's prompt once and every generated token once.
        assert (run.usage.prompt_tokens, run.usage.completion_tokens, run.usage.cached_tokens) == (3, 6, 3)
        assert migrations(metrics, code) == 1


async def test_the_frontend_limit_overrides_the_cards(tokenizer):
    async with Workers(tokenizer, codes.SHUTTING_DOWN, sent=2) as w:
        with pytest.raises(WorkerFailed, match="going away"):
            await Run(w.model(tokenizer, card_limit=3), w.client, req(), migration=MigrationConfig(limit=0)).text()
        assert await Run(w.model(tokenizer), w.client, req(), migration=MigrationConfig(limit=1)).text()
        assert len(w.received) == 1


async def test_limit_zero_and_not_retryable_errors_fail_as_before(tokenizer):
    for code, limit in ((codes.SHUTTING_DOWN, 0), (codes.INTERNAL, 3)):
        async with Workers(tokenizer, code, sent=2) as w:
            metrics = FrontendMetrics()
            with pytest.raises(WorkerFailed) as info:
                await Run(w.model(tokenizer, card_limit=limit), w.client, req(), metrics).text()
            assert "not migrated" not in info.value.message and not w.received
            assert migrations(metrics, code) == 0


async def test_used_up_limit_is_counted(tokenizer):
    async with Workers(tokenizer, codes.SHUTTING_DOWN, sent=1) as w:
        failing = w.servers[0].address  # two instances, both failing
        model = served(tokenizer, [instance("a", failing), instance("c", failing)])
        metrics = FrontendMetrics()
        with pytest.raises(WorkerFailed, match=r"not migrated: the migration limit \(1\) is reached"):
            await Run(model, w.client, req(), metrics, migration=MigrationConfig(limit=1)).text()
        assert migrations(metrics, codes.SHUTTING_DOWN) == 1
        exceeded = metrics.registry.get_sample_value("turbine_frontend_migration_limit_exceeded_total", {"model": "m"})
        assert exceeded == 1


@pytest.mark.parametrize("fields,why", [
    ({"structured_outputs": StructuredOutputs(regex="[a-z ]+")}, "mid-grammar"),
    ({"sampling": SamplingOptions(n=2)}, "n > 1"),
    ({"prompt_embeds": b"tensor"}, "embeddings"),
])
async def test_what_cannot_continue_fails_with_its_reason_unless_nothing_was_generated(tokenizer, fields, why):
    async with Workers(tokenizer, codes.SHUTTING_DOWN, sent=2) as w:
        with pytest.raises(WorkerFailed, match=f"not migrated: .*{why}"):
            await Run(w.model(tokenizer), w.client, req(**fields), migration=MigrationConfig(limit=2)).text()
        assert not w.received
    if "sampling" in fields:
        return  # the stand-in worker answers one choice
    async with Workers(tokenizer, codes.SHUTTING_DOWN, sent=0) as w:
        # Before its first token it starts over whole on the other worker.
        text = await Run(w.model(tokenizer), w.client, req(**fields), migration=MigrationConfig(limit=2)).text()
        assert text == " one two three four five six" and w.received[0].token_ids == PROMPT


async def test_max_seq_len_bounds_what_migrates(tokenizer):
    async with Workers(tokenizer, codes.SHUTTING_DOWN, sent=2) as w:
        with pytest.raises(WorkerFailed, match="--migration-max-seq-len 4"):
            await Run(w.model(tokenizer), w.client, req(),
                      migration=MigrationConfig(limit=2, max_seq_len=4)).text()
        assert await Run(w.model(tokenizer), w.client, req(),
                         migration=MigrationConfig(limit=2, max_seq_len=5)).text()


def test_continuation_drops_what_was_sent_already():
    original = req(output=OutputOptions(logprobs=1, prompt_logprobs=2), kv_transfer_params={"x": 1}, dp_rank=1)
    cont = continuation(original, [7, 8], 2)
    assert cont.token_ids == PROMPT + [7, 8] and cont.stop.max_tokens == 4 and cont.request_id == "r1-m2"
    assert cont.output == OutputOptions(logprobs=1)  # the prompt's logprobs came with the first chunk
    assert cont.kv_transfer_params is None and cont.dp_rank is None
    assert continuation(original, [], 1).token_ids == PROMPT  # nothing generated: the whole request again
    with pytest.raises(ValueError, match="--migration-limit"):
        MigrationConfig(limit=-1)


def test_frontend_flags_and_env(monkeypatch, capsys):
    assert parse_frontend_args([]).migration == MigrationConfig(limit=None, max_seq_len=None)
    cfg = parse_frontend_args(["--migration-limit", "3", "--migration-max-seq-len", "4096"])
    assert cfg.migration == MigrationConfig(limit=3, max_seq_len=4096)
    monkeypatch.setenv("TURBINE_MIGRATION_LIMIT", "0")
    assert parse_frontend_args([]).migration.limit == 0
    for argv, flag in ((["--migration-limit", "-1"], "--migration-limit"),
                       (["--migration-max-seq-len", "0"], "--migration-max-seq-len")):
        with pytest.raises(SystemExit):
            parse_frontend_args(argv)
        assert flag in capsys.readouterr().err


class WideningWorkers(Workers):
    """As Workers, but the finishing worker's engine widens each image token by 16 (a prompt with images)."""

    async def finishing(self, req, ctx):
        async for chunk in super().finishing(req, ctx):
            if chunk.usage is not None:
                chunk.usage.prompt_tokens += 16 * len(req.images or ())
            yield chunk


async def test_a_continued_request_with_an_image_counts_the_engines_prompt_once(tokenizer):
    from turbine.protocol.generate import ImageInput

    async with WideningWorkers(tokenizer, codes.SHUTTING_DOWN, sent=2) as w:
        run = Run(w.model(tokenizer, card_limit=1), w.client, req(images=[ImageInput(data=b"png", hash="h")]))
        assert await run.text() == " one two three four five six"
        (got,) = w.received
        assert got.images == [ImageInput(data=b"png", hash="h")]  # the continuation carries the image
        # The engine's prompt (3 tokens, one image widened by 16), not its prompt plus the tokens generated.
        assert (run.usage.prompt_tokens, run.usage.completion_tokens) == (19, 6)
