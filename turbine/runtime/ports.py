"""A free local port to give a process we are about to start (a worker the planner launches, the
servers the tests and benchmarks start).

A port from `bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range, so between closing the
probe socket and the new process binding it, any outgoing connection (a NATS or etcd client, the new
process's own dials) can take it as its local port — CI lost a test module to exactly that ("address
already in use"). So these ports lie below the ephemeral range, where the kernel never picks on its
own, and one process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidates() -> range:
    low, high = _ephemeral_range()
    if low > 12000:
        return range(10000, low)
    return range(high + 1, 65535)  # an unusual range: use what lies above it


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, outside the ephemeral range."""
    ports = _candidates()
    for _ in range(200):
        port = random.randrange(ports.start, ports.stop)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free local port in {ports.start}-{ports.stop - 1}")
