"""turbine.runtime.ports: ports the kernel does not hand to outgoing connections, never the same one twice."""

from __future__ import annotations

import socket

import pytest

from turbine.runtime.ports import CLAIM_RANGE, _ephemeral_range, free_port


def test_ports_lie_outside_the_ephemeral_range_and_are_not_repeated():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(not low <= p <= high for p in ports)
    # nor where claimed ports lie (bound only long after they are claimed, by another process)
    assert all(not CLAIM_RANGE[0] <= p < CLAIM_RANGE[1] for p in ports)
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr("turbine.runtime.ports._candidates", lambda: range(port, port + 1))
        with pytest.raises(RuntimeError, match=f"no free local port in {port}-{port}"):
            free_port()
