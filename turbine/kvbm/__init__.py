"""Turbine's multi-tier KV block storage (host memory, local disk, shared directory); see README.md."""

from turbine.kvbm.block import Block, CorruptBlock
from turbine.kvbm.files import DiskStore, FileCheck, SharedStore, shared_tier_id
from turbine.kvbm.metrics import KvbmMetrics
from turbine.kvbm.store import BlockStore, HostStore
from turbine.kvbm.tiered import BlockEvent, TieredStore, TierEvent

__all__ = ["Block", "BlockEvent", "BlockStore", "CorruptBlock", "DiskStore", "FileCheck", "HostStore", "KvbmMetrics",
           "SharedStore", "TierEvent", "TieredStore", "shared_tier_id"]
