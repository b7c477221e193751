"""Settings shared by every Turbine process (discovery), read from CLI flags, a --config file or env,
and the way every config checks itself.

Config flows one way: flags/file/env (turbine.flag_sources) -> a typed config object -> components. Each config object
validates itself when built (`__post_init__`), so one built in code (tests, benchmarks, a
planner launching workers) is checked exactly like one built from flags; `*_from_args` only
reads flags and turns a ConfigError into the parser's error message."""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass, field, fields

from turbine.flag_sources import env_bool, env_choice, env_float, env_str
from turbine.runtime.discovery import default_file_dir
from turbine.runtime.event_plane import DEFAULT_NATS_SERVER
from turbine.runtime.discovery.endpoints import EndpointError, etcd_grpc_target

DEFAULT_NAMESPACE = "turbine"
DISCOVERY_BACKENDS = ("file", "etcd")
REQUEST_PLANES = ("tcp", "nats")


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
        if self.backend == "etcd":
            try:
                etcd_grpc_target(self.etcd_endpoints)
            except EndpointError as exc:
                check(self, False, "etcd_endpoints", str(exc))


def add_discovery_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Turbine discovery")
    group.add_argument(
        "--discovery-backend", choices=DISCOVERY_BACKENDS,
        default=env_str("TURBINE_DISCOVERY_BACKEND", "file"),
        help="where instances and model cards are published (env TURBINE_DISCOVERY_BACKEND)",
    )
    group.add_argument(
        "--discovery-dir", default=env_str("TURBINE_DISCOVERY_DIR"),
        help="directory of the file backend (env TURBINE_DISCOVERY_DIR; default $TMPDIR/turbine_discovery)",
    )
    group.add_argument(
        "--etcd-endpoints", default=env_str("TURBINE_ETCD_ENDPOINTS", "127.0.0.1:2379"),
        help="comma-separated host:port list of etcd servers (env TURBINE_ETCD_ENDPOINTS)",
    )
    group.add_argument(
        "--discovery-ttl", type=float, default=env_float("TURBINE_DISCOVERY_TTL", 10.0),
        help="seconds after which a dead process's records disappear (env TURBINE_DISCOVERY_TTL)",
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


@dataclass(frozen=True)
class ClusterSecurityConfig:
    """What guards the internal planes (request plane, event plane) of this process: the
    cluster key all members share, and TLS files for the request plane. `insecure`: a worker
    or router may listen beyond loopback without a key."""

    cluster_key: str | None = flag("--cluster-key", default=None)
    cluster_key_file: str | None = flag("--cluster-key-file", default=None)
    tls_cert: str | None = flag("--tls-cert", default=None)
    tls_key: str | None = flag("--tls-key", default=None)
    tls_ca: str | None = flag("--tls-ca", default=None)
    insecure: bool = flag("--insecure", default=False)

    def __post_init__(self):
        from turbine.runtime.cluster_auth import MIN_KEY_BYTES

        check(self, not (self.cluster_key and self.cluster_key_file), "cluster_key_file",
              "give the key once: --cluster-key or --cluster-key-file, not both")
        if self.cluster_key is not None:
            check(self, len(self.cluster_key.encode()) >= MIN_KEY_BYTES, "cluster_key",
                  f"must have at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)")
        if self.cluster_key_file is not None:
            check(self, os.path.isfile(self.cluster_key_file), "cluster_key_file",
                  f"{self.cluster_key_file!r}: no such file")
            check(self, len(self._read_key_file()) >= MIN_KEY_BYTES, "cluster_key_file",
                  f"{self.cluster_key_file!r}: the key in it must have at least {MIN_KEY_BYTES} bytes")
        given = [name for name in ("tls_cert", "tls_key", "tls_ca") if getattr(self, name)]
        check(self, len(given) in (0, 3), "tls_ca" if "tls_ca" not in given else given[0],
              "TLS needs all three of --tls-cert, --tls-key and --tls-ca")
        for name in given:
            check(self, os.path.isfile(getattr(self, name)), name, f"{getattr(self, name)!r}: no such file")

    def _read_key_file(self) -> bytes:
        with open(self.cluster_key_file, "rb") as f:
            return f.read().strip()

    @property
    def has_key(self) -> bool:
        return bool(self.cluster_key or self.cluster_key_file)

    @property
    def authenticates(self) -> bool:
        """Peers must prove themselves: a key, or mutual TLS."""
        return self.has_key or self.tls_cert is not None

    def check_listen(self, config: object, field_name: str, host: str) -> None:
        """A listener beyond loopback needs --cluster-key (or mutual TLS) or --insecure."""
        from turbine.runtime.cluster_auth import is_loopback

        check(config, is_loopback(host) or self.authenticates or self.insecure, field_name,
              f"{host!r} is beyond loopback, and without a cluster key anyone who reaches it can use this "
              f"process's internal planes: give --cluster-key / --cluster-key-file (env TURBINE_CLUSTER_KEY / "
              f"TURBINE_CLUSTER_KEY_FILE) or --tls-cert/--tls-key/--tls-ca, or --insecure to serve it "
              f"unauthenticated")

    def auth(self):
        """The runtime's ClusterAuth (reads the key file)."""
        from turbine.runtime.cluster_auth import ClusterAuth, TlsFiles

        key = self.cluster_key.encode() if self.cluster_key else self._read_key_file() if self.cluster_key_file \
            else None
        tls = TlsFiles(self.tls_cert, self.tls_key, self.tls_ca) if self.tls_cert else None
        return ClusterAuth(key, tls)


def add_cluster_security_args(parser: argparse.ArgumentParser, listens: bool = True) -> None:
    """`listens`: the process serves an internal plane (a worker, the router), so --insecure applies."""
    env = env_str
    g = parser.add_argument_group("Turbine cluster security (the internal request and event planes)")
    g.add_argument("--cluster-key", default=env("TURBINE_CLUSTER_KEY"),
                   help="secret every process of the cluster shares; request-plane connections must prove it and "
                        "event-plane messages are signed with it (env TURBINE_CLUSTER_KEY; prefer the env or "
                        "--cluster-key-file: a flag's value is visible in `ps`)")
    g.add_argument("--cluster-key-file", default=env("TURBINE_CLUSTER_KEY_FILE"),
                   help="file holding the cluster key (surrounding whitespace ignored; env TURBINE_CLUSTER_KEY_FILE)")
    g.add_argument("--tls-cert", default=env("TURBINE_TLS_CERT"),
                   help="PEM certificate of this process: with --tls-key and --tls-ca, the request plane is "
                        "mutual TLS (env TURBINE_TLS_CERT)")
    g.add_argument("--tls-key", default=env("TURBINE_TLS_KEY"),
                   help="PEM private key of --tls-cert (env TURBINE_TLS_KEY)")
    g.add_argument("--tls-ca", default=env("TURBINE_TLS_CA"),
                   help="PEM CA that signs the cluster's certificates; peers must present one (env TURBINE_TLS_CA)")
    if listens:
        g.add_argument("--insecure", action="store_true",
                       default=env_bool("TURBINE_INSECURE"),
                       help="allow listening beyond loopback (--host) without a cluster key or TLS "
                            "(env TURBINE_INSECURE=1)")


def cluster_security_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ClusterSecurityConfig:
    with config_errors_to(parser):
        return ClusterSecurityConfig(cluster_key=args.cluster_key or None,
                                     cluster_key_file=args.cluster_key_file or None,
                                     tls_cert=args.tls_cert or None, tls_key=args.tls_key or None,
                                     tls_ca=args.tls_ca or None, insecure=getattr(args, "insecure", False))


@dataclass(frozen=True)
class RequestPlaneConfig:
    """The request plane this process serves and calls on: "tcp" (each server listens on its own
    port; turbine/runtime/request_plane.py) or "nats" (through the NATS server `nats_server`;
    turbine/runtime/request_plane_nats.py). Every process of a deployment uses the same one: a
    frontend or router never calls an instance registered on the other (its address says which)."""

    kind: str = flag("--request-plane", default="tcp")
    nats_server: str = flag("--nats-server", default=DEFAULT_NATS_SERVER)

    def __post_init__(self):
        from turbine.runtime.event_plane_nats import parse_server

        check(self, self.kind in REQUEST_PLANES, "kind", f"{self.kind!r}: choose from {', '.join(REQUEST_PLANES)}")
        try:
            parse_server(self.nats_server)
        except ValueError as exc:
            check(self, False, "nats_server", str(exc))

    def check_security(self, config: object, security: ClusterSecurityConfig) -> None:
        """TLS files are the TCP plane's: with nats they would do nothing, so they are refused."""
        check(config, self.kind == "tcp" or security.tls_cert is None, "security",
              "--tls-cert/--tls-key/--tls-ca secure the tcp request plane; with --request-plane nats use the "
              "NATS server's own TLS and --cluster-key (every message is signed)")

    def serves(self, address: str) -> bool:
        """Whether an instance registered at `address` is on this plane."""
        return address.startswith("nats://") == (self.kind == "nats")

    def server(self, host: str = "127.0.0.1", port: int = 0, **kwargs):
        """A request-plane server on this plane (`host`/`port`: the tcp plane's listener)."""
        if self.kind == "nats":
            from turbine.runtime.request_plane_nats import NatsRequestPlaneServer

            return NatsRequestPlaneServer(self.nats_server, **kwargs)
        from turbine.runtime.request_plane import RequestPlaneServer

        return RequestPlaneServer(host=host, port=port, **kwargs)

    def client(self, **kwargs):
        """A request-plane client on this plane."""
        if self.kind == "nats":
            from turbine.runtime.request_plane_nats import NatsRequestPlaneClient

            return NatsRequestPlaneClient(self.nats_server, **kwargs)
        from turbine.runtime.request_plane import RequestPlaneClient

        return RequestPlaneClient(**kwargs)

    def install(self) -> None:
        """Make this the plane of the clients that parts of this process make for themselves (a KV
        router fetching missed events: `request_plane.new_client()`). Entry points call it once."""
        from turbine.runtime import request_plane

        request_plane.install_client_factory(self.client)


def add_request_plane_args(group, nats_server: bool = True) -> None:
    """`--request-plane`, and `--nats-server` unless the parser has it already (a worker's, shared
    with its event plane)."""
    group.add_argument("--request-plane", choices=REQUEST_PLANES,
                       default=env_choice("TURBINE_REQUEST_PLANE", REQUEST_PLANES, "tcp"),
                       help="how requests reach workers: tcp (each worker listens on a port of its own) or nats "
                            "(through the NATS server of --nats-server: hosts need reach only it); every process "
                            "of a deployment must use the same (env TURBINE_REQUEST_PLANE)")
    if nats_server:
        group.add_argument("--nats-server", default=env_str("TURBINE_NATS_SERVER", DEFAULT_NATS_SERVER),
                           help="NATS server (nats://HOST:PORT) of --request-plane nats (env TURBINE_NATS_SERVER)")


def request_plane_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RequestPlaneConfig:
    from turbine.runtime.event_plane_nats import parse_server

    nats_server = args.nats_server
    with contextlib.suppress(ValueError):  # RequestPlaneConfig names the flag
        nats_server = parse_server(nats_server)
    with config_errors_to(parser):
        return RequestPlaneConfig(kind=args.request_plane, nats_server=nats_server)
