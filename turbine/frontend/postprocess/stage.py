"""The postprocess stage: a worker's raw outputs -> per-choice Deltas. Per choice it
detokenizes incrementally, applies stop strings, keeps logprobs and counts usage; then each
delta passes a chain of output parsers (reasoning and tool-call parsers; turbine/frontend/preprocess/tools.py
picks them per request). Outputs that arrived together are merged into one delta per choice."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from turbine.frontend.deltas import Delta, OutputParser, OutputSpec, TokenLogprob, UsageCount
from turbine.frontend.errors import WorkerFailed
from turbine.frontend.models.tokenizer import TextTokenizer
from turbine.frontend.postprocess.detokenizer import IncrementalDetokenizer
from turbine.protocol.generate import GenerateOutput


class Postprocess:
    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int], n: int, spec: OutputSpec,
                 parsers: Callable[[], list[OutputParser]] = list, prompt_from_worker: bool = False):
        """`parsers` makes one choice's parser chain; `prompt_from_worker`: the usage's prompt length is the
        worker's (a prompt with images, which the engine widens), not len(prompt_ids)."""
        self.detoks = [IncrementalDetokenizer(tokenizer, prompt_ids, stop=spec.stop,
                                              skip_special_tokens=spec.skip_special_tokens,
                                              include_stop_str_in_output=spec.include_stop_str_in_output)
                       for _ in range(n)]
        self.chains = [parsers() for _ in range(n)]
        self.finished = [False] * n
        # Special tokens kept (for parsers' markers): the end-of-sequence token is still not text.
        self.eos = set(tokenizer.eos_token_ids) if not spec.skip_special_tokens else set()
        self.usage = UsageCount(prompt_tokens=len(prompt_ids))
        # No prompt ids (prompt embeddings): the worker reports the prompt's length.
        self._prompt_from_worker = prompt_from_worker or not prompt_ids
        # The prompt's logprobs (echo with logprobs), filled in place when the worker sends them.
        self.prompt_logprobs: list[TokenLogprob] = []
        self._prompt_ids = prompt_ids

    def apply(self, chunk: GenerateOutput) -> Delta | None:
        """The delta of one output chunk, parsed (None once its choice has finished)."""
        delta = self.unparsed(chunk)
        return None if delta is None else self.parsed(delta)

    def unparsed(self, chunk: GenerateOutput) -> Delta | None:
        """The delta of one output chunk before the parser chain (None once its choice has finished)."""
        i = chunk.index
        if chunk.prompt_log_probs is not None and not self.prompt_logprobs:
            tops = chunk.prompt_top_logprobs or [[] for _ in chunk.prompt_log_probs]
            self.prompt_logprobs.extend(TokenLogprob(t, lp, [(x.token_id, x.logprob) for x in top])
                                        for t, lp, top in zip(self._prompt_ids, chunk.prompt_log_probs, tops))
        if self.finished[i]:
            return None
        detok = self.detoks[i]
        self.usage.completion_tokens += len(chunk.token_ids)
        ids = chunk.token_ids
        if self.eos and chunk.finish_reason == "stop" and ids and ids[-1] in self.eos:
            ids = ids[:-1]
        delta = Delta(i, detok.push(ids) if ids else "")
        if chunk.log_probs is not None:
            tops = chunk.top_logprobs or [[] for _ in chunk.token_ids]
            delta.logprobs = [TokenLogprob(t, lp, [(x.token_id, x.logprob) for x in top])
                              for t, lp, top in zip(chunk.token_ids, chunk.log_probs, tops)]
        if detok.stopped:
            delta.finish_reason = "stop"
        elif chunk.finish_reason is not None:
            delta.text += detok.flush()
            delta.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            if self._prompt_from_worker:
                self.usage.prompt_tokens = chunk.usage.prompt_tokens
            self.usage.cached_tokens = max(self.usage.cached_tokens, chunk.usage.cached_tokens or 0)
        if delta.finish_reason is not None:
            self.finished[i] = True
        return delta

    def parsed(self, delta: Delta) -> Delta:
        """The delta through its choice's parser chain; a finished choice is marked."""
        for parser in self.chains[delta.index]:
            delta = parser.push(delta)
            if delta.finish_reason is not None:
                delta = parser.finish(delta)
        if delta.finish_reason is not None:
            self.finished[delta.index] = True
        return delta

    async def deltas(self, outputs: AsyncIterator[GenerateOutput], more_ready: Callable[[], bool],
                     on_done: Callable[[UsageCount], None] = lambda usage: None) -> AsyncIterator[Delta]:
        """The request's deltas. Outputs that arrived together (`more_ready()`: the next one is
        already here) are merged into one delta per choice, as vLLM's server does when it falls
        behind: the client gets the same text, sooner, in fewer events. The parser chain runs on
        the merged deltas (parsers give the same result however the text is split), so a busy
        frontend parses once per event rather than once per token. Closing this generator
        closes `outputs` (which cancels the request on its worker)."""
        held: Delta | None = None
        try:
            async with contextlib.aclosing(outputs):
                async for chunk in outputs:
                    delta = self.unparsed(chunk)
                    if delta is not None:
                        if held is not None and held.mergeable_with(delta):
                            held.text += delta.text
                            held.finish_reason = delta.finish_reason
                        else:
                            if held is not None:
                                yield self.parsed(held)
                            held = delta
                    if all(self.finished):
                        break
                    if held is not None and not more_ready():
                        yield self.parsed(held)
                        held = None
                else:
                    raise WorkerFailed("worker ended the stream before every choice finished")
            if held is not None:
                yield self.parsed(held)
        finally:
            on_done(self.usage)


class TextPostprocess(Postprocess):
    """Text mode (turbine.frontend.preprocess.text_mode): the worker's text passes through (no detokenizer,
    no stop strings: the engine applied them); the prompt's token count comes from the worker."""

    def __init__(self, n: int, parsers: Callable[[], list[OutputParser]] = list):
        self.chains = [parsers() for _ in range(n)]
        self.finished = [False] * n
        self.usage = UsageCount(prompt_tokens=0)
        self.prompt_logprobs: list[TokenLogprob] = []  # never: text mode refuses logprobs

    def unparsed(self, chunk: GenerateOutput) -> Delta | None:
        i = chunk.index
        if self.finished[i]:
            return None
        self.usage.completion_tokens += len(chunk.token_ids)
        delta = Delta(i, chunk.text or "", finish_reason=chunk.finish_reason)
        if chunk.usage is not None:
            self.usage.prompt_tokens = chunk.usage.prompt_tokens
            self.usage.cached_tokens = max(self.usage.cached_tokens, chunk.usage.cached_tokens or 0)
        if delta.finish_reason is not None:
            self.finished[i] = True
        return delta
