"""A batch of completion prompts (`prompt` is a list of strings or of token-id lists): one
pipeline (one worker request) per prompt, run concurrently, written as one response. As in
OpenAI and vLLM, prompt i's choice j has index i * n + j and the usage is the sum."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.responses import Response

from turbine.frontend.deltas import Delta, UsageCount
from turbine.frontend.errors import RequestError, WorkerFailed
from turbine.frontend.event_stream import EventStreamResponse
from turbine.frontend.pipeline import Writing
from turbine.frontend.postprocess.format import SseChunks

log = logging.getLogger("turbine.frontend")


class BatchRun:
    def __init__(self, runs: list):
        """`runs`: one http._Run per prompt, in prompt order."""
        self.runs = runs
        self.n = runs[0].prepared.request.sampling.n
        self.prepared = runs[0].prepared

    def usage(self) -> UsageCount:
        total = UsageCount(prompt_tokens=0)
        for run in self.runs:
            total.prompt_tokens += run.post.usage.prompt_tokens
            total.completion_tokens += run.post.usage.completion_tokens
            total.cached_tokens += run.post.usage.cached_tokens
        return total

    async def whole(self) -> Response:
        tasks = [asyncio.ensure_future(run.choices()) for run in self.runs]
        try:
            per_prompt = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one prompt failed: the others stop too (cancelled on their workers)
                task.cancel()
        choices = []
        for i, prompt_choices in enumerate(per_prompt):
            for choice in prompt_choices:
                choices.append({**choice, "index": i * self.n + choice["index"]})
        return Response(self.runs[0].fmt.response(choices, self.usage()), media_type="application/json")

    async def stream(self) -> EventStreamResponse:
        # Every prompt's first output before answering, so that an error any worker finds at
        # once still becomes an HTTP status.
        firsts = [asyncio.ensure_future(anext(run.deltas, None)) for run in self.runs]
        try:
            first = await asyncio.gather(*firsts)
        except BaseException:
            for task in firsts:
                task.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for run in self.runs:
                await run.deltas.aclose()
            raise
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(i, run, delta, queue))
                 for i, (run, delta) in enumerate(zip(self.runs, first))]
        head = self.runs[0]
        sse = SseChunks(head.fmt, self.prepared.include_usage)
        continuous = self.prepared.continuous_usage

        async def body():
            with Writing(head.metrics) as writing:
                try:
                    for i, run in enumerate(self.runs):
                        for choices in run.fmt.opening(self.n):
                            yield sse.chunk(self._offset(i, choices), self.usage() if continuous else None)
                    running = len(self.runs)
                    while running:
                        i, item = await queue.get()
                        if item is None:
                            running -= 1
                        elif isinstance(item, BaseException):
                            raise item
                        elif item.shown():
                            yield sse.chunk(self._offset(i, [self.runs[i].fmt.chunk_choice(item)]),
                                            self.usage() if continuous else None)
                    if self.prepared.include_usage:
                        yield sse.chunk([], self.usage())
                    writing.done = True
                except RequestError as exc:
                    log.warning("stream failed: %s", exc)
                    yield sse.error(str(exc), "worker_error" if isinstance(exc, WorkerFailed) else exc.type, exc.code)
                    writing.done = True
                finally:
                    for pump in pumps:
                        pump.cancel()
                    await asyncio.gather(*pumps, return_exceptions=True)
            yield SseChunks.DONE

        return EventStreamResponse(body(), more_ready=lambda: not queue.empty())

    def _offset(self, prompt: int, choices: list[dict]) -> list[dict]:
        return [{**c, "index": prompt * self.n + c["index"]} for c in choices]

    @staticmethod
    async def _pump(i: int, run, first: Delta | None, queue: asyncio.Queue) -> None:
        """Prompt i's deltas into the shared queue; then None (or the error that ended them)."""
        deltas: AsyncIterator[Delta] = run.deltas
        try:
            async with contextlib.aclosing(deltas):
                delta = first
                while delta is not None:
                    queue.put_nowait((i, delta))
                    delta = await anext(deltas, None)
            queue.put_nowait((i, None))
        except RequestError as exc:
            queue.put_nowait((i, exc))
