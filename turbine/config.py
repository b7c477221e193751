"""Settings shared by every Turbine process (discovery), read from CLI flags or env."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from turbine.runtime.discovery import default_file_dir

DEFAULT_NAMESPACE = "turbine"
DISCOVERY_BACKENDS = ("file", "etcd")


@dataclass(frozen=True)
class DiscoveryConfig:
    backend: str = "file"
    file_dir: str = field(default_factory=default_file_dir)
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    ttl: float = 10.0


def add_discovery_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Turbine discovery")
    group.add_argument(
        "--discovery-backend", choices=DISCOVERY_BACKENDS,
        default=os.environ.get("TURBINE_DISCOVERY_BACKEND", "file"),
        help="where instances and model cards are published (env TURBINE_DISCOVERY_BACKEND)",
    )
    group.add_argument(
        "--discovery-dir", default=os.environ.get("TURBINE_DISCOVERY_DIR"),
        help="directory of the file backend (env TURBINE_DISCOVERY_DIR; default $TMPDIR/turbine_discovery)",
    )
    group.add_argument(
        "--etcd-endpoints", default=os.environ.get("TURBINE_ETCD_ENDPOINTS", "127.0.0.1:2379"),
        help="comma-separated host:port list of etcd servers (env TURBINE_ETCD_ENDPOINTS)",
    )
    group.add_argument(
        "--discovery-ttl", type=float, default=float(os.environ.get("TURBINE_DISCOVERY_TTL", "10")),
        help="seconds after which a dead process's records disappear",
    )


def discovery_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DiscoveryConfig:
    if args.discovery_ttl <= 0:
        parser.error("--discovery-ttl must be > 0")
    endpoints = tuple(e.strip().removeprefix("http://") for e in args.etcd_endpoints.split(",") if e.strip())
    if args.discovery_backend == "etcd" and not endpoints:
        parser.error("--etcd-endpoints is empty but --discovery-backend is etcd")
    return DiscoveryConfig(backend=args.discovery_backend, file_dir=args.discovery_dir or default_file_dir(),
                           etcd_endpoints=endpoints, ttl=args.discovery_ttl)


def make_registry(cfg: DiscoveryConfig):
    from turbine.runtime.discovery import make_backend
    from turbine.runtime.discovery.registry import Registry

    backend = make_backend(cfg.backend, etcd_endpoints=list(cfg.etcd_endpoints),
                           file_dir=cfg.file_dir, ttl=cfg.ttl)
    return Registry(backend)
