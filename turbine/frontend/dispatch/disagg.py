"""Disaggregated serving, the frontend's policy: when to compute a prompt's KV on a prefill
worker and hand its location to the decode worker that generates (the dispatch stage does it).

A model is disaggregated while it has live prefill workers (their cards say so); when the last
one leaves, requests go whole to the decode workers again, which then prefill themselves.
Prompts whose part not yet cached on the chosen decode worker is short are prefilled there:
moving their KV costs more than it saves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from turbine.config import check, flag
from turbine.frontend.models.table import ServedModel
from turbine.protocol.encode import EMBEDDING_TRANSPORTS
from turbine.protocol.generate import GenerateRequest

# A prefill worker with this many scheduler steps' worth of prompt tokens queued from us is
# saturated; when all are, the decode worker prefills instead of waiting in that queue.
SATURATION_STEPS = 4


@dataclass(frozen=True)
class DisaggConfig:
    # Prompts with fewer tokens to compute on the decode worker are prefilled there. 256: from
    # there on, on the 2-core CPU host, handing over added at most 25 % to a lone prompt's TTFT
    # while a local prefill would stall the decode worker's streams for a second or more
    # (docs/benchmarks/disagg.md, "Disaggregated prefill/decode", crossover).
    max_local_prefill_length: int = flag("--max-local-prefill-length", default=256)
    # A prefill worker that answers later is given up on.
    prefill_timeout_s: float = flag("--prefill-timeout", default=60.0)
    # Disaggregated encode (encode.py): how image embeddings travel from encode workers to the workers that
    # take them: "nixl" (the encode worker's host memory, read by NIXL) or "file" (a file on the same host).
    image_embedding_transport: str = flag("--image-embedding-transport", default="nixl")
    # An encode worker that answers later is given up on (the next is tried; none left: workers encode).
    encode_timeout_s: float = flag("--encode-timeout", default=60.0)

    def __post_init__(self):
        check(self, self.max_local_prefill_length >= 0, "max_local_prefill_length", "must be >= 0")
        check(self, self.prefill_timeout_s > 0, "prefill_timeout_s", "must be > 0")
        check(self, self.image_embedding_transport in EMBEDDING_TRANSPORTS, "image_embedding_transport",
              f"{self.image_embedding_transport!r}: choose from {', '.join(EMBEDDING_TRANSPORTS)}")
        check(self, self.encode_timeout_s > 0, "encode_timeout_s", "must be > 0")


class PrefillFailed(Exception):
    """No prefill worker produced the KV; the decode worker computes the prompt itself."""


def may_prefill_remotely(model: ServedModel, request: GenerateRequest) -> bool:
    # vLLM's connector hands one sequence's KV to one request; n > 1 choices each need the
    # prompt's KV, so they are prefilled where they are decoded (served, not refused). Prompt
    # embeddings are computed where they are decoded too (prefill workers refuse them), and so are images
    # unless every prefill worker takes them (--enable-multimodal), and a prompt whose logprobs are asked for
    # (echo with logprobs).
    return (bool(model.prefill_instances) and request.sampling.n == 1 and request.prompt_embeds is None
            and (not request.images or all(card.multimodal for card in model.prefill_cards.values()))
            and request.output.prompt_logprobs is None)


def wants_remote_prefill(model: ServedModel, request: GenerateRequest, cfg: DisaggConfig,
                         decode_cached_tokens: int = 0) -> bool:
    """Whether to prefill on a prefill worker: the part of the prompt the decode worker would
    have to compute (`decode_cached_tokens` of it are probably cached there) is long enough."""
    if not may_prefill_remotely(model, request):
        return False
    if len(request.token_ids) - decode_cached_tokens < cfg.max_local_prefill_length:
        return False
    return not all(_saturated(model, inst.instance_id) for inst in model.prefill_instances)


def _saturated(model: ServedModel, instance_id: str) -> bool:
    card = model.prefill_cards.get(instance_id)
    budget = SATURATION_STEPS * (card.max_num_batched_tokens if card else 8192)
    return model.prefill_queued_tokens.get(instance_id, 0) >= budget


async def first_output_of_handoff(stream):
    """The decode worker's first output for a request whose KV a prefill worker holds.
    If our caller is cancelled meanwhile (client gone), the hand-off still completes in the
    background and only then is the decode request cancelled: the decode worker must pull the
    KV (or fail to), else the prefill worker keeps those blocks pinned until its connector's
    lease runs out."""
    first = asyncio.ensure_future(anext(stream))
    try:
        return await asyncio.shield(first)
    except asyncio.CancelledError:
        if not first.done():
            task = asyncio.get_running_loop().create_task(_cancel_after(first, stream))
            _handoffs.add(task)
            task.add_done_callback(_handoffs.discard)
        raise


_handoffs: set[asyncio.Task] = set()  # strong references until they finish


async def _cancel_after(first: asyncio.Future, stream) -> None:
    try:
        await first
    except BaseException:  # noqa: BLE001 - any outcome ends the hand-off
        pass
    finally:
        await stream.aclose()
