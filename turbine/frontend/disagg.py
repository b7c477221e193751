"""Disaggregated serving, the frontend's half: compute a prompt's KV on a prefill worker, then
hand its location to the decode worker that generates.

A model is disaggregated while it has live prefill workers (their cards say so); when the last
one leaves, requests go whole to the decode workers again, which then prefill themselves.
Prompts whose part not yet cached on the chosen decode worker is short are prefilled there:
moving their KV costs more than it saves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec

from turbine.frontend.models import ServedModel
from turbine.frontend.openai_schemas import RequestError
from turbine.protocol import errors as codes
from turbine.protocol.generate import GenerateOutput, GenerateRequest
from turbine.runtime.errors import ConnectFailed, PeerDisconnected, RemoteError

log = logging.getLogger("turbine.frontend")

# A prefill worker with this many scheduler steps' worth of prompt tokens queued from us is
# saturated; when all are, the decode worker prefills instead of waiting in that queue.
SATURATION_STEPS = 4


@dataclass(frozen=True)
class DisaggConfig:
    # Prompts with fewer tokens to compute on the decode worker are prefilled there. 256: from
    # there on, on the 2-core CPU host, handing over added at most 25 % to a lone prompt's TTFT
    # while a local prefill would stall the decode worker's streams for a second or more
    # (benchmarks/RESULTS.md, "Disaggregated prefill/decode", crossover).
    max_local_prefill_length: int = 256
    prefill_timeout_s: float = 60.0  # a prefill worker that answers later is given up on


class PrefillFailed(Exception):
    """No prefill worker produced the KV; the decode worker computes the prompt itself."""


def may_prefill_remotely(model: ServedModel, request: GenerateRequest) -> bool:
    # vLLM's connector hands one sequence's KV to one request; n > 1 choices each need the
    # prompt's KV, so they are prefilled where they are decoded (served, not refused).
    return bool(model.prefill_instances) and request.sampling.n == 1


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


async def remote_prefill(model: ServedModel, client, request: GenerateRequest,
                         cfg: DisaggConfig) -> tuple[dict, int]:
    """Runs the prompt on a prefill worker (max_tokens 1) and returns the KV connector's
    parameters for the decode worker, and how many prompt tokens the prefill worker found
    in its cache. A worker that is unreachable, dies, errs or times out is
    skipped for another; when none is left, PrefillFailed. Cancelling cancels the prefill."""
    stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=None)
    prefill_req = msgspec.structs.replace(request, stop=stop)
    router = model.prefill_router
    tried: set[str] = set()
    while True:
        candidates = [i for i in model.prefill_instances if i.instance_id not in tried]
        if not candidates:
            raise PrefillFailed(f"no prefill worker left to try ({len(tried)} failed)")
        target = router.select(candidates, prefill_req)
        inst = target.instance
        tried.add(inst.instance_id)
        queued = model.prefill_queued_tokens
        queued[inst.instance_id] = queued.get(inst.instance_id, 0) + len(request.token_ids)
        try:
            attempt = msgspec.structs.replace(prefill_req, dp_rank=target.dp_rank)
            return await asyncio.wait_for(_prefill_on(client, inst, attempt, router), cfg.prefill_timeout_s)
        except RequestError:
            raise
        except RemoteError as exc:
            if exc.code == codes.INVALID_REQUEST:
                raise RequestError(f"invalid request: {exc.message}") from None
            log.warning("prefill of request %s on worker %s failed (%s: %s); trying another",
                        request.request_id, inst.instance_id, exc.code, exc.message)
        except (ConnectFailed, PeerDisconnected, PrefillFailed, TimeoutError) as exc:
            log.warning("prefill of request %s on worker %s failed (%s: %s); trying another",
                        request.request_id, inst.instance_id, type(exc).__name__, exc)
        finally:
            queued[inst.instance_id] -= len(request.token_ids)
            router.finished(request.request_id)


async def _prefill_on(client, inst, request: GenerateRequest, router) -> tuple[dict, int]:
    async with client.stream(inst.address, inst.endpoint, request, GenerateOutput) as stream:
        async for chunk in stream:
            if chunk.token_ids:
                router.first_token(request.request_id)
            reason = chunk.finish_reason
            if reason is None:
                continue
            if reason.startswith("error: invalid request"):
                raise RequestError(reason.removeprefix("error: "))
            if reason.startswith("error") or reason == "cancelled":
                raise PrefillFailed(reason)
            if not chunk.kv_transfer_params:
                raise PrefillFailed("the prefill worker returned no KV transfer parameters")
            cached = chunk.usage.cached_tokens or 0 if chunk.usage else 0
            return chunk.kv_transfer_params, cached
    raise PrefillFailed("the prefill worker ended the stream without finishing")


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
