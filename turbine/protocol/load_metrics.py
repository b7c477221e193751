"""A worker's load, as its engine sees it: what a KV router weighs against cached overlap.

Published on the event plane (topic LOAD_METRICS_TOPIC) by every worker that has one, per
data-parallel rank, when the numbers change (coalesced: at most one message per short
interval, the latest state wins) and now and then even when they don't, so that a router
that starts later learns them.

The fields added after version 1 (max_loras, active_loras) have defaults: older reports decode
with LoRA off."""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1


class LoadMetrics(msgspec.Struct, omit_defaults=True, kw_only=True):
    instance_id: str
    dp_rank: int = 0
    kv_active_blocks: int  # KV blocks held by running requests (not the free or evictable ones)
    kv_total_blocks: int
    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued for admission
    # LoRA: how many adapters the engine can hold active at once (vLLM's --max-loras GPU slots; 0: LoRA
    # off), and the adapters in those slots now, least recently used first. A request whose adapter is
    # not among them waits for a swap (and, while every slot serves running requests, for a free slot).
    max_loras: int = 0
    active_loras: list[str] = msgspec.field(default_factory=list)
    v: int = WIRE_VERSION
