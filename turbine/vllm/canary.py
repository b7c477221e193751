"""The vLLM worker's health canary: generate one token on the engine."""

from __future__ import annotations

import asyncio
import uuid

from vllm import SamplingParams

CANARY_TIMEOUT_S = 10.0


async def engine_canary(engine) -> str | None:
    """None when the engine generated a token, else the reason it did not."""
    request_id = f"canary-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    try:
        async with asyncio.timeout(CANARY_TIMEOUT_S):
            async for _ in engine.generate({"prompt_token_ids": [1]}, params, request_id):
                pass
    except TimeoutError:
        await engine.abort(request_id)
        return f"canary generate did not finish in {CANARY_TIMEOUT_S:.0f}s"
    except Exception as exc:
        return f"canary generate failed: {type(exc).__name__}: {exc}"
    return None
