"""Command line of the standalone router service (`python -m turbine.router`) → RouterServiceConfig.
Its KV routing flags are the frontend's kv mode's (turbine.router.config)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from turbine.config import DEFAULT_NAMESPACE, ClusterSecurityConfig, DiscoveryConfig, check, config_errors_to, flag
from turbine.config import RequestPlaneConfig, add_cluster_security_args, add_discovery_args, add_request_plane_args
from turbine.config import cluster_security_from_args, discovery_config_from_args, request_plane_from_args
from turbine.flag_sources import add_config_arg, env_errors, env_int, env_str, with_config_file
from turbine.logging_setup import add_logging_args
from turbine.router.config import KvRouterConfig, add_kv_router_args, kv_router_config_from_args
from turbine.tracing import add_tracing_args

DEFAULT_REQUEST_TTL_S = 600.0


@dataclass(frozen=True)
class RouterServiceConfig:
    # Where it registers, and whose workers it routes to.
    namespace: str = flag("--namespace", default=DEFAULT_NAMESPACE)
    host: str = flag("--host", default="127.0.0.1")  # request-plane bind address
    port: int = flag("--port", default=0)
    system_host: str = "127.0.0.1"
    system_port: int | None = flag("--system-port", default=None)  # /health, /live, /metrics; off when None
    kv: KvRouterConfig = field(default_factory=KvRouterConfig)
    request_ttl_s: float = flag("--router-request-ttl", default=DEFAULT_REQUEST_TTL_S)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    security: ClusterSecurityConfig = field(default_factory=ClusterSecurityConfig)
    # The plane it serves best_worker on and fetches workers' missed KV events over.
    request_plane: RequestPlaneConfig = field(default_factory=RequestPlaneConfig)

    def __post_init__(self):
        ns = self.namespace
        check(self, bool(ns) and "/" not in ns and ns.replace("-", "").replace("_", "").isalnum(), "namespace",
              f"{ns!r}: use letters, digits, '-' and '_' only")
        for name in ("port", "system_port"):
            port = getattr(self, name)
            check(self, port is None or 0 <= port <= 65535, name, f"{port}: must be between 0 and 65535")
        check(self, self.request_ttl_s > 0, "request_ttl_s", "must be > 0")
        self.security.check_listen(self, "host", self.host)
        self.request_plane.check_security(self, self.security)


def build_parser() -> argparse.ArgumentParser:
    with env_errors("python -m turbine.router"):
        return _build_parser()


def _build_parser() -> argparse.ArgumentParser:
    env = env_str
    p = argparse.ArgumentParser(
        prog="python -m turbine.router",
        description="Standalone KV-aware router: follows the workers in discovery and answers "
                    "best_worker (plus first_token / finished notices) over the request plane.")
    add_config_arg(p)
    g = p.add_argument_group("Turbine router")
    g.add_argument("--namespace", default=env("TURBINE_NAMESPACE", DEFAULT_NAMESPACE),
                   help="register in this namespace and route among its workers (env TURBINE_NAMESPACE)")
    g.add_argument("--host", default=env("TURBINE_REQUEST_PLANE_HOST", "127.0.0.1"),
                   help="request-plane bind address (env TURBINE_REQUEST_PLANE_HOST; default 127.0.0.1)")
    g.add_argument("--port", type=int, default=env_int("TURBINE_REQUEST_PLANE_PORT", 0),
                   help="request-plane port (0 = any free port; env TURBINE_REQUEST_PLANE_PORT)")
    g.add_argument("--system-host", default=env("TURBINE_SYSTEM_HOST", "127.0.0.1"),
                   help="bind address of the status server (env TURBINE_SYSTEM_HOST; default 127.0.0.1)")
    g.add_argument("--system-port", type=int, default=env_int("TURBINE_SYSTEM_PORT", None),
                   help="port of the status server (/health, /live, /metrics); off when unset "
                        "(env TURBINE_SYSTEM_PORT)")
    g.add_argument("--router-request-ttl", type=float, default=DEFAULT_REQUEST_TTL_S, metavar="SECONDS",
                   help="a placed request whose 'finished' notice has not come after this long stops counting "
                        "as load (its caller is presumed gone)")
    add_kv_router_args(g)
    add_discovery_args(p)
    add_cluster_security_args(p)
    add_request_plane_args(p.add_argument_group("Turbine request plane"))
    add_logging_args(p)
    add_tracing_args(p)
    return p


def parse_router_args(argv: list[str] | None = None) -> RouterServiceConfig:
    parser = build_parser()
    args = parser.parse_args(with_config_file(parser, argv))
    kv = kv_router_config_from_args(args, parser)
    discovery = discovery_config_from_args(args, parser)
    security = cluster_security_from_args(args, parser)
    request_plane = request_plane_from_args(args, parser)
    with config_errors_to(parser):
        return RouterServiceConfig(namespace=args.namespace, host=args.host, port=args.port,
                                   system_host=args.system_host, system_port=args.system_port, kv=kv,
                                   request_ttl_s=args.router_request_ttl, discovery=discovery,
                                   security=security, request_plane=request_plane)
