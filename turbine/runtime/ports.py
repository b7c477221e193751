"""A free local port to give a process we are about to start (a worker the planner launches, the
servers the tests and benchmarks start).

A port from `bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range, so between closing the
probe socket and the new process binding it, any outgoing connection (a NATS or etcd client, the new
process's own dials) can take it as its local port — CI lost a test module to exactly that ("address
already in use"). So these ports lie below the ephemeral range, where the kernel never picks on its
own, and one process never hands out the same port twice.

A port that a process binds only tens of seconds after choosing it (the NIXL side channel, the
KV-event relay: both bound once the engine is built) is claimed instead (claim_port_run): locked
for the process's lifetime, so that no other Turbine process on the host chooses it meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile

_handed_out: set[int] = set()
# Where claim_port_run chooses: below the usual ephemeral range, and above where free_port chooses.
CLAIM_RANGE = (20000, 32000)


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
        # Below the claimed ports too (claim_port_run): a port claimed now is bound only later.
        return range(10000, min(low, CLAIM_RANGE[0]))
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


# Lock files, one per claimed port, held open (flock) for the claiming process's lifetime: the lock dies
# with the process.
_LOCK_DIR = os.path.join(tempfile.gettempdir(), "turbine-ports")
_held_locks: list = []


def claim_port_run(host: str, count: int, purpose: str) -> int:
    """A port P such that P..P+count-1 on `host` are free now and locked for this process, for a port that
    is bound long after it is chosen. RuntimeError naming `purpose` if there is no such run."""
    os.makedirs(_LOCK_DIR, exist_ok=True)
    low, high = CLAIM_RANGE
    start = random.randrange(low, high)
    for i in range(high - low):
        port = low + (start - low + i) % (high - low)
        if port + count - 1 >= high:
            continue
        locks = [_try_lock(p) for p in range(port, port + count)]
        if all(locks) and all(is_free(host, p) for p in range(port, port + count)):
            _held_locks.extend(locks)
            return port
        for lock in locks:
            if lock:
                lock.close()
    raise RuntimeError(f"no run of {count} free ports in {low}-{high} on {host} for {purpose}")


def _try_lock(port: int):
    f = open(os.path.join(_LOCK_DIR, f"{port}.lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def is_free(host: str, port: int) -> bool:
    """Nothing is bound to `port` on `host` now (a plain socket bound and closed at once)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
