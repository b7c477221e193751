"""The KV router's one config (KvRouterConfig) and its flags, shared by every process that routes
by KV cache: the frontend in `--router-mode kv` and the standalone router service. The KV block
size is not in it: it comes from each model's card, so one config serves models of any block size.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from turbine.config import check, config_errors_to, flag
from turbine.router.approx import DEFAULT_TTL_S
from turbine.router.event_watchdog import DEFAULT_DEADLINE_S

# Prefill blocks weigh 4 decode blocks: on the 16-worker fleet benchmark (docs/benchmarks/routing.md,
# 2026-11-26) weight 4 beat 1 on TTFT p50/p99 and cache hits for both workloads; computing a block
# of prompt costs the engine far more than holding one more block while decoding.
DEFAULT_OVERLAP_WEIGHT = 4.0
# A request whose adapter is not in a worker's active LoRA slots costs that worker this many blocks
# more (the swap, and the wait for a slot). Chosen from the LoRA fleet benchmark (docs/benchmarks/routing.md,
# "Adapter-aware routing").
DEFAULT_LORA_SWAP_WEIGHT = 64.0


@dataclass(frozen=True)
class KvRouterConfig:
    overlap_weight: float = flag("--router-kv-overlap-score-weight", default=DEFAULT_OVERLAP_WEIGHT)
    temperature: float = flag("--router-temperature", default=0.0)  # 0: always the cheapest worker
    # False: approximate routing, the index learned from the router's own decisions
    use_kv_events: bool = flag("--no-router-kv-events", default=True)
    # False: the workers' KV tier events (--connector kvbm) are dropped, the router sees their engines' caches
    # only (engine-only routing: the peer the tier-aware cost is measured against).
    use_kv_tiers: bool = flag("--no-router-kv-tiers", default=True)
    # Expected KV events later than this after a first token: a warning naming the worker.
    events_deadline_s: float = flag("--router-kv-events-deadline", default=DEFAULT_DEADLINE_S)
    approx_ttl_s: float = DEFAULT_TTL_S  # approximate mode: how long a routed prefix counts as cached
    # LoRA: the extra cost, in blocks, of a worker whose active slots lack the request's adapter; 0: ignore slots.
    lora_swap_weight: float = flag("--router-lora-swap-weight", default=DEFAULT_LORA_SWAP_WEIGHT)

    def __post_init__(self):
        check(self, self.overlap_weight >= 0, "overlap_weight", "must be >= 0")
        check(self, self.temperature >= 0, "temperature", "must be >= 0")
        check(self, self.events_deadline_s > 0, "events_deadline_s", "must be > 0")
        check(self, self.approx_ttl_s > 0, "approx_ttl_s", "must be > 0")
        check(self, self.lora_swap_weight >= 0, "lora_swap_weight", "must be >= 0")
        check(self, self.use_kv_tiers or self.use_kv_events, "use_kv_tiers",
              "drops the workers' KV tier events; with --no-router-kv-events there are none to drop")


def add_kv_router_args(group, scope: str = "") -> None:
    """The KV router's tuning flags; `scope` prefixes their help (the frontend says "kv mode: ")."""
    group.add_argument("--router-kv-overlap-score-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
                       help=f"{scope}weight of the prefill blocks a worker would still compute, against its "
                            "decode load")
    group.add_argument("--router-temperature", type=float, default=0.0,
                       help=f"{scope}0 picks the cheapest worker; > 0 samples by softmax over the costs")
    group.add_argument("--no-router-kv-events", dest="router_kv_events", action="store_false",
                       help=f"{scope}approximate routing, learned from the router's own decisions (entries "
                            f"expire after {DEFAULT_TTL_S:.0f} s) instead of the workers' KV events")
    group.add_argument("--no-router-kv-tiers", dest="router_kv_tiers", action="store_false",
                       help=f"{scope}ignore the KV tier events of workers with offload tiers (--connector kvbm): "
                            "route by their engines' caches only, as if a block that left the engine were gone")
    group.add_argument("--router-kv-events-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                       help=f"{scope}warn (naming the worker) when a worker's KV events have not arrived this "
                            "long after it prefilled blocks the router did not know it held")
    group.add_argument("--router-lora-swap-weight", type=float, default=DEFAULT_LORA_SWAP_WEIGHT, metavar="BLOCKS",
                       help=f"{scope}a request for a LoRA adapter costs a worker whose active adapter slots lack it "
                            f"this many KV blocks more (default {DEFAULT_LORA_SWAP_WEIGHT:g}); 0 ignores the slots")


def kv_router_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> KvRouterConfig:
    with config_errors_to(parser):
        return KvRouterConfig(overlap_weight=args.router_kv_overlap_score_weight,
                              temperature=args.router_temperature, use_kv_events=args.router_kv_events,
                              use_kv_tiers=args.router_kv_tiers,
                              events_deadline_s=args.router_kv_events_deadline,
                              lora_swap_weight=args.router_lora_swap_weight)
