"""`prompt_embeds` on /v1/completions: a prompt given as embeddings, base64 of a torch.save'd
2-D tensor (sequence x hidden size). The frontend never loads it (no torch here): it checks
that the model's workers take prompt embeddings, that the base64 is sound and that the payload
is within --max-prompt-embeds-bytes, and sends the bytes on to the worker, which loads them with
torch's weights-only loader and checks rank, hidden size, dtype and length (a 400 naming
prompt_embeds when wrong)."""

from __future__ import annotations

from typing import Any

from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ServedModel
from turbine.frontend.preprocess.base64_payload import decode_base64

PARAM = "prompt_embeds"
# Decoded bytes; the request plane's frames hold 32 MiB, the whole request included.
DEFAULT_MAX_PROMPT_EMBEDS_BYTES = 4 << 20
MAX_PROMPT_EMBEDS_BYTES = 24 << 20


async def prompt_embeds_payload(value: Any, model: ServedModel, max_bytes: int) -> bytes:
    """The tensor file's bytes, or a RequestError naming prompt_embeds."""
    if isinstance(value, list):
        raise RequestError(f"{PARAM}: a list (a batch of prompts) is not supported; send one base64 tensor "
                           "per request", param=PARAM)
    if not isinstance(value, str):
        raise RequestError(f"{PARAM}: must be a base64 string (a torch.save'd tensor)", param=PARAM)
    cards = model.cards.values() or [model.card]
    if not all(card.accepts_prompt_embeds for card in cards):
        raise RequestError(f"{PARAM}: the model {model.name!r} is served by workers that do not take prompt "
                           "embeddings (start them with --enable-prompt-embeds)", param=PARAM)
    return await decode_base64(value, max_bytes=max_bytes, where=PARAM, what="the payload",
                               flag="--max-prompt-embeds-bytes", param=PARAM)
