"""Request-plane handlers of one simulated worker: `generate` and `clear_kv_blocks`, with the
same payloads and the same answers as the vLLM worker's (turbine/vllm/handlers.py).

In disaggregated serving a prefill worker computes one token and hands over the prompt's KV
(kv_transfer_params on its last chunk); a decode worker given those parameters pulls the KV
instead of computing the prompt (kv_transfer.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from turbine.mocker.engine import MockEngine
from turbine.mocker.kv_transfer import prefill_params, wants_remote_prefill
from turbine.mocker.scheduler import SeqOutput, Sequence
from turbine.mocker.tokens import Choice, prompt_seed
from turbine.protocol.generate import (
    ClearKvBlocksRequest,
    GenerateOutput,
    GenerateRequest,
    StatusReply,
    TopLogprob,
    Usage,
)
from turbine.runtime.errors import AdapterNotLoaded, InvalidRequest
from turbine.worker.admission import Admission
from turbine.worker.worker_metrics import WorkerMetrics

MAX_N = 16  # choices per request; the frontend allows no more
MAX_LOGPROBS = 20  # top logprobs per token, vLLM's default limit
# The mocker has no tokenizer to render, tokenize or detokenize text with.
TEXT_MODE_UNSUPPORTED = "text mode (--use-vllm-tokenizer) is not supported by the mocker: send token_ids"


class Handlers:
    """What every role shares. `engines[r]` is data-parallel rank r's engine; a request's
    dp_rank picks one (None: the least loaded)."""

    def __init__(self, engines: list[MockEngine], metrics: WorkerMetrics, vocab_size: int, *,
                 instance_id: str = "", on_success: Callable[[], None] | None = None,
                 admission: Admission | None = None):
        self.engines = engines
        self.admission = admission or Admission(None, None)  # overload control (no bounds by default)
        self.metrics = metrics
        self.on_success = on_success  # told of each completed request (the health checks)
        self.vocab_size = vocab_size
        self.instance_id = instance_id  # a prefill's remote_engine_id
        self.max_model_len = engines[0].scheduler.max_model_len
        self.adapters: dict[str, int] = {}  # the LoRA adapters loaded (name -> id), kept by the worker

    def engine_for(self, req: GenerateRequest) -> MockEngine:
        """The engine of the request's dp_rank; without one, the rank with the fewest unfinished
        sequences (then the fewest blocks in use), as vLLM's DP coordinator balances."""
        if req.dp_rank is not None:
            if not 0 <= req.dp_rank < len(self.engines):
                raise InvalidRequest(f"dp_rank {req.dp_rank} out of range: this worker has data-parallel ranks "
                                     f"0..{len(self.engines) - 1}")
            return self.engines[req.dp_rank]
        if len(self.engines) == 1:
            return self.engines[0]
        return min(self.engines, key=lambda e: (e.scheduler.num_unfinished, e.scheduler.pool.num_in_use))

    def sequences(self, req: GenerateRequest) -> list[Sequence]:
        """The request's choices as scheduler sequences, after vLLM's input checks."""
        prompt = req.token_ids
        if req.lora_name is not None and req.lora_name not in self.adapters:
            raise AdapterNotLoaded(req.lora_name)
        if req.text is not None:
            raise InvalidRequest(f"text: {TEXT_MODE_UNSUPPORTED}")
        if req.structured_outputs is not None:
            # Its made-up tokens cannot follow a schema, regex or grammar.
            raise InvalidRequest("structured_outputs: the mocker cannot constrain its output",
                                 param="structured_outputs")
        if req.prompt_embeds is not None:  # its card says so too (accepts_prompt_embeds is false)
            raise InvalidRequest("prompt_embeds: the mocker does not take prompt embeddings")
        if req.images:  # its card says so too (multimodal is false)
            raise InvalidRequest("images: the mocker takes no images", param="images")
        if req.sampling.logit_bias:
            raise InvalidRequest("logit_bias: the mocker does not simulate logits")
        if req.output.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs: the mocker does not simulate logits")
        if not prompt:
            raise InvalidRequest("token_ids is empty")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens; the context length is {self.max_model_len}")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidRequest(f"token id out of vocabulary (size {self.vocab_size})")
        n = req.sampling.n
        if not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be between 1 and {MAX_N}, got {n}")
        if req.output.logprobs is not None and not 0 <= req.output.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.output.logprobs}")
        stop = req.stop
        max_tokens = stop.max_tokens if stop.max_tokens is not None else self.max_model_len - len(prompt)
        min_tokens = stop.min_tokens or 0
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}")
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidRequest(f"min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}")
        n, max_tokens, min_tokens = self._role_limits(n, max_tokens, min_tokens)
        pull = self._pulls_kv(req)
        seed = prompt_seed(prompt)
        stop_ids = frozenset(stop.stop_token_ids or ())
        # Unique per attempt, so a retried request id never collides inside the engine.
        base_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        return [Sequence(seq_id=f"{base_id}-{i}",
                         choice=Choice(seed=seed, index=i, min_tokens=min_tokens, stop_token_ids=stop_ids,
                                       ignore_eos=stop.ignore_eos),
                         tokens=list(prompt), num_prompt_tokens=len(prompt), max_tokens=max_tokens,
                         kv_to_pull=pull, lora_name=req.lora_name)
                for i in range(n)]

    def _role_limits(self, n: int, max_tokens: int, min_tokens: int) -> tuple[int, int, int]:
        return n, max_tokens, min_tokens

    def _pulls_kv(self, req: GenerateRequest) -> bool:
        return False

    def _finished(self, chunk: GenerateOutput, out: SeqOutput) -> None:
        """The role's additions to a choice's last chunk."""

    async def generate(self, req: GenerateRequest, ctx) -> AsyncIterator[GenerateOutput]:
        try:
            engine = self.engine_for(req)
            seqs = self.sequences(req)
        except InvalidRequest:
            self.metrics.error("invalid_request")
            raise  # the caller gets it as a typed error (HTTP 400 at the frontend)
        # Refused (OVERLOADED) here, before the engine sees it: nothing to free.
        ticket = self.admission.admit(0 if self._pulls_kv(req) else len(req.token_ids))
        outputs = engine.submit(seqs)
        unfinished = len(seqs)
        self.metrics.inflight.inc()
        try:
            while unfinished:
                # Outputs that piled up while we waited leave as one chunk per choice, like
                # vLLM's output collector merging deltas for a slow consumer.
                for chunk in self._chunks(await outputs.take(), req):
                    unfinished -= chunk.finish_reason is not None
                    ticket.started()
                    yield chunk
            self.metrics.request_done("success")
            if self.on_success is not None:
                self.on_success()
        finally:
            ticket.release()
            self.metrics.inflight.dec()
            if unfinished:
                # Caller cancelled or went away: free the simulated KV blocks now.
                self.metrics.cancellations.inc()
                engine.abort(seqs)

    async def clear_kv_blocks(self, req: ClearKvBlocksRequest, ctx) -> AsyncIterator[StatusReply]:
        if all([engine.scheduler.pool.reset() for engine in self.engines]):
            yield StatusReply(status="success", message="KV cache cleared")
        else:
            yield StatusReply(status="error", message="prefix cache not reset (requests still running)")

    def _chunks(self, outs: list[SeqOutput], req: GenerateRequest) -> list[GenerateOutput]:
        """One chunk per choice from the outputs of one or more steps."""
        top_k = req.output.logprobs
        chunks: dict[int, GenerateOutput] = {}
        for out in outs:
            index = out.seq.choice.index
            chunk = chunks.get(index)
            if chunk is None:
                chunk = chunks[index] = GenerateOutput(token_ids=[], index=index)
                if top_k is not None:
                    chunk.log_probs, chunk.top_logprobs = [], []
            chunk.token_ids.append(out.token)
            if top_k is not None:
                # Made-up but well-formed: the sampled token ranks first, the others follow it.
                logprob = -(out.token % 997) / 499
                chunk.log_probs.append(logprob)
                chunk.top_logprobs.append([TopLogprob(token_id=(out.token + r) % self.vocab_size, logprob=logprob - r)
                                           for r in range(top_k)])
            if out.finish_reason is not None:
                chunk.finish_reason, chunk.stop_reason = out.finish_reason, out.stop_reason
                chunk.usage = Usage(prompt_tokens=len(req.token_ids), completion_tokens=out.seq.num_output_tokens,
                                    cached_tokens=max(out.seq.num_cached_tokens, 0))
                self._finished(chunk, out)
        return list(chunks.values())


class AggregatedHandlers(Handlers):
    """Whole requests: prompt and answer."""


class PrefillHandlers(Handlers):
    """Computes the prompt and one token, and hands the prompt's KV over (kv_transfer_params on
    the last chunk) to the decode worker that generates the answer."""

    def _role_limits(self, n: int, max_tokens: int, min_tokens: int) -> tuple[int, int, int]:
        if n != 1:
            raise InvalidRequest(f"a prefill worker serves n=1 only, got n={n}")
        return 1, 1, min(min_tokens, 1)

    def _finished(self, chunk: GenerateOutput, out: SeqOutput) -> None:
        chunk.kv_transfer_params = prefill_params(self.instance_id, out.seq.seq_id, out.block_ids,
                                                  out.seq.num_prompt_tokens)


class DecodeHandlers(Handlers):
    """Given a prefill worker's kv_transfer_params, pulls the prompt's KV instead of computing
    it; without them, prefills locally."""

    def _pulls_kv(self, req: GenerateRequest) -> bool:
        return wants_remote_prefill(req.kv_transfer_params)


HANDLERS_OF_ROLE: dict[str, type[Handlers]] = {
    "agg": AggregatedHandlers, "prefill": PrefillHandlers, "decode": DecodeHandlers}
