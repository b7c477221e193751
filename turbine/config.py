"""Settings shared by every Turbine process (discovery), read from CLI flags or env, and the
way every config checks itself.

Config flows one way: flags/env -> a typed config object -> components. Each config object
validates itself when built (`__post_init__`), so one built in code (tests, benchmarks, a
planner launching workers) is checked exactly like one built from flags; `*_from_args` only
reads flags and turns a ConfigError into the parser's error message."""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass, field, fields

from turbine.runtime.discovery import default_file_dir

DEFAULT_NAMESPACE = "turbine"
DISCOVERY_BACKENDS = ("file", "etcd")


class ConfigError(ValueError):
    """A config field has a value that cannot work. The message names the field and, where it
    has one, the flag that sets it: "KvRouterConfig.temperature (--router-temperature): must be >= 0"."""

    def __init__(self, config: object, field_name: str, message: str):
        flag = _flag_of(type(config), field_name)
        where = f"{type(config).__name__}.{field_name}" + (f" ({flag})" if flag else "")
        super().__init__(f"{where}: {message}")
        self.field, self.flag = field_name, flag


def flag(name: str, **kwargs):
    """A dataclass field set by the command-line flag `name` (named in its ConfigError)."""
    return field(metadata={"flag": name}, **kwargs)


def _flag_of(cls: type, field_name: str) -> str | None:
    with contextlib.suppress(TypeError):
        for f in fields(cls):
            if f.name == field_name:
                return f.metadata.get("flag")
    return None


def check(config: object, ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(config, field_name, message)


@contextlib.contextmanager
def config_errors_to(parser: argparse.ArgumentParser):
    """Within: a ConfigError exits through `parser.error` (status 2, message naming the flag)."""
    try:
        yield
    except ConfigError as exc:
        parser.error(str(exc))


@dataclass(frozen=True)
class DiscoveryConfig:
    backend: str = flag("--discovery-backend", default="file")
    file_dir: str = flag("--discovery-dir", default_factory=default_file_dir)
    etcd_endpoints: tuple[str, ...] = flag("--etcd-endpoints", default=("127.0.0.1:2379",))
    ttl: float = flag("--discovery-ttl", default=10.0)

    def __post_init__(self):
        check(self, self.backend in DISCOVERY_BACKENDS, "backend", f"choose from {', '.join(DISCOVERY_BACKENDS)}")
        check(self, self.ttl > 0, "ttl", "must be > 0")
        check(self, self.backend != "etcd" or bool(self.etcd_endpoints), "etcd_endpoints",
              "is empty but the discovery backend is etcd")


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
    endpoints = tuple(e.strip().removeprefix("http://") for e in args.etcd_endpoints.split(",") if e.strip())
    with config_errors_to(parser):
        return DiscoveryConfig(backend=args.discovery_backend, file_dir=args.discovery_dir or default_file_dir(),
                               etcd_endpoints=endpoints, ttl=args.discovery_ttl)


def make_registry(cfg: DiscoveryConfig):
    from turbine.runtime.discovery import make_backend
    from turbine.runtime.discovery.registry import Registry

    backend = make_backend(cfg.backend, etcd_endpoints=list(cfg.etcd_endpoints),
                           file_dir=cfg.file_dir, ttl=cfg.ttl)
    return Registry(backend)
