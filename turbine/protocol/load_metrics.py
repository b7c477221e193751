"""A worker's load, as its engine sees it: what a KV router weighs against cached overlap.

Published on the event plane (topic LOAD_METRICS_TOPIC) by every worker that has one, per
data-parallel rank, when the numbers change (coalesced: at most one message per short
interval, the latest state wins) and now and then even when they don't, so that a router
that starts later learns them."""

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
    v: int = WIRE_VERSION
