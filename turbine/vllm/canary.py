"""The vLLM worker's health canary: the health check's payload (turbine/worker/health_check.py: one
greedy token after the tokenizer's BOS token by default, the text "Test" in text mode, or the operator's
--health-check-payload) sent through the worker's own request path on every engine (data-parallel
rank): the role's handler (vllm/handlers.py: a prefill worker runs it as a prefill, one token, whose KV
is freed when it ends rather than kept for a decode worker that would never come; a decode worker
decodes it; a text-mode worker renders and tokenizes its text), or a pooling worker's embed handler.
Not counted as a served request."""

from __future__ import annotations

import asyncio

from turbine.runtime.errors import RequestFailed
from turbine.worker import health_check
from turbine.worker.health_check import PayloadError

CANARY_TIMEOUT_S = 10.0


def _refused(what: str, exc: BaseException, payload: dict | None) -> str:
    source = f" (the {health_check.FLAG} payload)" if payload is not None else ""
    message = exc.error.message if isinstance(exc, RequestFailed) else f"{type(exc).__name__}: {exc}"
    return f"canary {what} refused{source}: {message}"


async def generate_canary(handlers, engine, payload: dict | None, text_mode: bool, ranks: int) -> str | None:
    """None when every rank answered the payload through the role's handler, else why not."""
    bos = health_check.bos_token_id(engine.get_tokenizer()) if not text_mode else health_check.DEFAULT_BOS
    for rank in range(ranks):
        try:
            req = health_check.generate_request(payload, bos=bos, text_mode=text_mode,
                                                dp_rank=rank if ranks > 1 else None)
        except PayloadError as exc:
            return _refused("generate", exc, payload)
        try:
            async with asyncio.timeout(CANARY_TIMEOUT_S):
                await handlers.canary(req)
        except TimeoutError:
            return f"canary generate did not finish in {CANARY_TIMEOUT_S:.0f}s (rank {rank})"
        except (RequestFailed, ValueError) as exc:  # the handler's checks, vLLM's input validation
            return _refused("generate", exc, payload)
        except Exception as exc:
            return f"canary generate failed: {type(exc).__name__}: {exc}"
    return None


async def pooling_canary(embed_handlers, engine, payload: dict | None) -> str | None:
    """None when the pooling worker's embed handler embedded the payload, else why not."""
    try:
        req = health_check.embed_request(payload, bos=health_check.bos_token_id(engine.get_tokenizer()))
    except PayloadError as exc:
        return _refused("embed", exc, payload)
    try:
        async with asyncio.timeout(CANARY_TIMEOUT_S):
            await embed_handlers.canary(req)
    except TimeoutError:
        return f"canary embed did not finish in {CANARY_TIMEOUT_S:.0f}s"
    except (RequestFailed, ValueError) as exc:
        return _refused("embed", exc, payload)
    except Exception as exc:
        return f"canary embed failed: {type(exc).__name__}: {exc}"
    return None
