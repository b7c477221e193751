"""Command line of the KV router: the flags it shares with the frontend's kv mode, and the
standalone router service's (`python -m turbine.router`) → RouterServiceConfig."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from turbine.config import DEFAULT_NAMESPACE, DiscoveryConfig, add_discovery_args, discovery_config_from_args
from turbine.router.event_watchdog import DEFAULT_DEADLINE_S
from turbine.router.kv_router import DEFAULT_OVERLAP_WEIGHT

DEFAULT_REQUEST_TTL_S = 600.0


def add_kv_router_args(group, scope: str = "") -> None:
    """The KV router's tuning flags; `scope` prefixes their help (the frontend says "kv mode: ")."""
    group.add_argument("--router-kv-overlap-score-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
                       help=f"{scope}weight of the prefill blocks a worker would still compute, against its "
                            "decode load")
    group.add_argument("--router-temperature", type=float, default=0.0,
                       help=f"{scope}0 picks the cheapest worker; > 0 samples by softmax over the costs")
    group.add_argument("--no-router-kv-events", dest="router_kv_events", action="store_false",
                       help=f"{scope}approximate routing, learned from the router's own decisions (entries "
                            "expire after 120 s) instead of the workers' KV events")
    group.add_argument("--router-kv-events-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                       help=f"{scope}warn (naming the worker) when a worker's KV events have not arrived this "
                            "long after it prefilled blocks the router did not know it held")


def check_kv_router_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.router_kv_overlap_score_weight < 0:
        parser.error("--router-kv-overlap-score-weight must be >= 0")
    if args.router_temperature < 0:
        parser.error("--router-temperature must be >= 0")
    if args.router_kv_events_deadline <= 0:
        parser.error("--router-kv-events-deadline must be > 0")


@dataclass(frozen=True)
class RouterServiceConfig:
    namespace: str = DEFAULT_NAMESPACE  # where it registers, and whose workers it routes to
    host: str = "127.0.0.1"  # request-plane bind address
    port: int = 0
    system_host: str = "127.0.0.1"
    system_port: int | None = None  # /health, /live, /metrics; off when None
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    temperature: float = 0.0
    kv_events: bool = True
    kv_events_deadline_s: float = DEFAULT_DEADLINE_S
    request_ttl_s: float = DEFAULT_REQUEST_TTL_S
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m turbine.router",
        description="Standalone KV-aware router: follows the workers in discovery and answers "
                    "best_worker (plus first_token / finished notices) over the request plane.")
    g = p.add_argument_group("Turbine router")
    g.add_argument("--namespace", default=env("TURBINE_NAMESPACE", DEFAULT_NAMESPACE),
                   help="register in this namespace and route among its workers")
    g.add_argument("--host", default=env("TURBINE_REQUEST_PLANE_HOST", "127.0.0.1"), help="request-plane bind address")
    g.add_argument("--port", type=int, default=int(env("TURBINE_REQUEST_PLANE_PORT", "0")),
                   help="request-plane port (0 = any free port)")
    g.add_argument("--system-host", default=env("TURBINE_SYSTEM_HOST", "127.0.0.1"))
    g.add_argument("--system-port", type=int, default=int(env("TURBINE_SYSTEM_PORT")) if env("TURBINE_SYSTEM_PORT")
                   else None, help="port of the status server (/health, /live, /metrics); off when unset")
    g.add_argument("--router-request-ttl", type=float, default=DEFAULT_REQUEST_TTL_S, metavar="SECONDS",
                   help="a placed request whose 'finished' notice has not come after this long stops counting "
                        "as load (its caller is presumed gone)")
    add_kv_router_args(g)
    add_discovery_args(p)
    return p


def parse_router_args(argv: list[str] | None = None) -> RouterServiceConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_kv_router_args(args, parser)
    ns = args.namespace
    if not ns or "/" in ns or not ns.replace("-", "").replace("_", "").isalnum():
        parser.error(f"--namespace {ns!r}: use letters, digits, '-' and '_' only")
    for flag, port in (("--port", args.port), ("--system-port", args.system_port)):
        if port is not None and not 0 <= port <= 65535:
            parser.error(f"{flag} {port}: must be between 0 and 65535")
    if args.router_request_ttl <= 0:
        parser.error("--router-request-ttl must be > 0")
    return RouterServiceConfig(
        namespace=ns, host=args.host, port=args.port, system_host=args.system_host, system_port=args.system_port,
        overlap_weight=args.router_kv_overlap_score_weight, temperature=args.router_temperature,
        kv_events=args.router_kv_events, kv_events_deadline_s=args.router_kv_events_deadline,
        request_ttl_s=args.router_request_ttl, discovery=discovery_config_from_args(args, parser))
