"""Service discovery: a leased key-value store (file or etcd backend) and a typed registry."""

from __future__ import annotations

import os
import tempfile

from turbine.runtime.discovery.base import DiscoveryBackend
from turbine.runtime.discovery.registry import Registry

__all__ = ["DiscoveryBackend", "Registry", "default_file_dir", "make_backend"]

BACKENDS = ("file", "etcd")


def default_file_dir() -> str:
    """$TURBINE_DISCOVERY_DIR, else $TMPDIR/turbine_discovery."""
    return os.environ.get("TURBINE_DISCOVERY_DIR") or os.path.join(tempfile.gettempdir(), "turbine_discovery")


def make_backend(
    kind: str, *, etcd_endpoints: list[str] | None, file_dir: str | None, ttl: float
) -> DiscoveryBackend:
    """Build (not start) the backend named by --discovery-backend."""
    if kind == "file":
        from turbine.runtime.discovery.file import FileDiscovery

        return FileDiscovery(file_dir or default_file_dir(), ttl=ttl)
    if kind == "etcd":
        # Imported lazily: grpc is heavy and the file backend does not need it.
        from turbine.runtime.discovery.etcd import EtcdDiscovery

        return EtcdDiscovery(etcd_endpoints or ["127.0.0.1:2379"], ttl=ttl)
    raise ValueError(f"unknown --discovery-backend {kind!r}; choose one of: {', '.join(BACKENDS)}")
