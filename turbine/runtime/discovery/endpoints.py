"""etcd endpoints (`host:port`, from --etcd-endpoints) → the gRPC target the etcd client dials.

etcd3aio always dials `ipv4:a,b,…`, which takes IPv4 literals only: a DNS name (a Kubernetes
Service, a compose service) failed at start with "the target uri is not valid". So: IP literals
keep that round-robin list; a DNS name goes to gRPC's DNS resolver, which balances over every
address the name has and resolves it again when it reconnects (an etcd pod that moved). gRPC has
no target for several names, so those are refused (give one name for the whole cluster)."""

from __future__ import annotations

import ipaddress


class EndpointError(ValueError):
    pass


def _host(endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EndpointError(f"{endpoint!r}: expected HOST:PORT")
    return host.strip("[]")


def _family(host: str) -> int | None:
    """4 or 6 for an IP literal (localhost counts as 127.0.0.1), None for a DNS name."""
    if host == "localhost":
        return 4
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def etcd_grpc_target(endpoints: list[str] | tuple[str, ...]) -> str:
    if not endpoints:
        raise EndpointError("no endpoints")
    families = {_family(_host(e)) for e in endpoints}
    if families == {4}:
        return "ipv4:" + ",".join(e.replace("localhost", "127.0.0.1") for e in endpoints)
    if families == {6}:
        return "ipv6:" + ",".join(endpoints)
    if len(endpoints) == 1:
        return f"dns:///{endpoints[0]}"
    raise EndpointError(f"{','.join(endpoints)}: give IP addresses of one family, or one DNS name for the whole "
                        "cluster (e.g. a Kubernetes Service); gRPC cannot balance over several names")
