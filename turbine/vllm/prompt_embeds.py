"""Prompt embeddings from the wire (GenerateRequest.prompt_embeds): the bytes of a torch.save'd
2-D tensor (sequence x hidden size), loaded the way vLLM's own OpenAI server loads them —
torch's weights-only loader (no arbitrary unpickling) under sparse-tensor invariant checks, and
a sparse tensor densified only within vLLM's memory budget — then checked against the model.
Every fault is an InvalidRequest naming prompt_embeds (HTTP 400 at the frontend)."""

from __future__ import annotations

import io

import torch
from vllm.exceptions import VLLMValidationError
from vllm.utils.sparse_utils import check_sparse_tensor_invariants_threadsafe

from turbine.runtime.errors import InvalidRequest
from turbine.vllm.compat import safe_to_dense

PARAM = "prompt_embeds"
_MAX_REASON = 200  # torch's reason is built from the caller's bytes: bounded, not echoed whole


def load_prompt_embeds(payload: bytes, *, hidden_size: int, dtype: torch.dtype, max_model_len: int) -> torch.Tensor:
    """The (sequence, hidden_size) tensor in the model's dtype; InvalidRequest if it is not one."""
    with check_sparse_tensor_invariants_threadsafe():
        try:
            tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        except (torch.OutOfMemoryError, MemoryError):
            raise  # the server's condition, not the caller's
        except Exception as exc:  # torch has no one error type for "not a tensor file"
            reason = (str(exc).strip() or type(exc).__name__)[:_MAX_REASON]
            raise InvalidRequest(f"{PARAM}: could not be loaded as a torch tensor: {reason}") from None
        try:
            tensor = safe_to_dense(tensor, parameter=PARAM)
        except VLLMValidationError as exc:
            raise InvalidRequest(f"{PARAM}: {exc}") from None
    if tensor.dim() != 2:
        raise InvalidRequest(f"{PARAM}: must be a 2-D tensor (sequence length, hidden size {hidden_size}); "
                             f"got shape {tuple(tensor.shape)}")
    length, width = tensor.shape
    if width != hidden_size:
        raise InvalidRequest(f"{PARAM}: hidden size {width} does not match the model's {hidden_size}")
    if length == 0:
        raise InvalidRequest(f"{PARAM}: the sequence is empty")
    if length >= max_model_len:
        raise InvalidRequest(f"{PARAM}: the sequence has {length} positions; the context length is {max_model_len}")
    if not tensor.is_floating_point():
        # An integer or bool tensor is a caller's mistake (token ids? quantized?), not something to cast.
        raise InvalidRequest(f"{PARAM}: dtype {tensor.dtype} is not a floating-point type")
    return tensor.to(dtype)
