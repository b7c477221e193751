"""Disaggregated serving, simulated: what a prefill worker hands over and how long the decode
worker takes to pull it.

A prefill worker's last chunk carries kv_transfer_params shaped like vLLM's NixlConnector's
(do_remote_prefill, remote_engine_id, remote_request_id, remote_block_ids, ...), so that the
frontend treats simulated and real workers alike. A decode worker given such parameters pulls
the prompt's KV in `tokens × bytes_per_token / bandwidth` seconds of simulated time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KV_BYTES_PER_ELEMENT = 2  # fp16/bf16: vLLM serves fp32 checkpoints in 16 bits on GPUs too
DEFAULT_BANDWIDTH_GB_S = 25.0  # a 200 Gb/s RDMA link, a common NIXL path between GPU hosts


def kv_bytes_per_token(config: dict) -> int | None:
    """KV cache bytes of one token for a Hugging Face model config: K and V, for every layer and
    KV head (SmolLM2-135M: 2 × 30 layers × 3 heads × 64 dims × 2 bytes = 23040); None when the
    config does not say."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim")
    if head_dim is None and heads and config.get("hidden_size"):
        head_dim = config["hidden_size"] // heads
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * KV_BYTES_PER_ELEMENT


@dataclass(frozen=True)
class KvTransferModel:
    bytes_per_token: int
    bandwidth_bytes_per_s: float

    def seconds(self, num_tokens: int) -> float:
        """Unscaled time to pull the KV of `num_tokens` tokens."""
        return num_tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


def prefill_params(engine_id: str, request_id: str, block_ids: Sequence[int], num_tokens: int) -> dict[str, Any]:
    """What a prefill worker returns: where a decode worker finds the prompt's KV."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_request_id": request_id, "remote_block_ids": list(block_ids), "remote_num_tokens": num_tokens}


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """Whether a request's kv_transfer_params ask its worker to pull the prompt's KV."""
    return bool(params) and params.get("do_remote_prefill") is True
