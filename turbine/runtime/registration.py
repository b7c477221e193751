"""Publishing a serving instance in discovery: one InstanceRecord per endpoint it serves,
then its model card, which is what makes the frontend route to it."""

from __future__ import annotations

import logging
import os
import socket

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.runtime.discovery.registry import Registry

log = logging.getLogger("turbine.registration")

CLEAR_KV_BLOCKS = "clear_kv_blocks"  # every worker serves it beside its generate endpoint
KV_EVENTS_REPLAY = "kv_events_replay"  # served by workers that publish KV events (missed events, snapshots)


def advertised_host(host: str) -> str:
    """A wildcard bind (0.0.0.0 / ::) is not an address others can dial: publish this host's."""
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def advertised_address(bound: str) -> str:
    if "://" in bound:  # a NATS request plane's address names the NATS server and a subject: as it is
        return bound
    host, _, port = bound.rpartition(":")
    return f"{advertised_host(host)}:{port}"


async def register(registry: Registry, card: ModelCard, address: str) -> list[InstanceRecord]:
    """Publish the instance of `card` serving at `address`; returns its records for `unregister`."""
    common = dict(namespace=card.namespace, component=card.component, instance_id=card.instance_id,
                  address=address, pid=os.getpid(), hostname=socket.gethostname())
    records = [InstanceRecord(endpoint=card.endpoint, **common),
               InstanceRecord(endpoint=CLEAR_KV_BLOCKS, **common)]
    if card.kv_events_address is not None:
        records.append(InstanceRecord(endpoint=KV_EVENTS_REPLAY, **common))
    for rec in records:
        await registry.register_instance(rec)
    await registry.register_model(card)
    return records


async def unregister(registry: Registry, records: list[InstanceRecord]) -> None:
    for rec in records:
        try:
            await registry.unregister_instance(rec)
        except Exception as exc:  # discovery down: the TTL removes us anyway
            log.warning("could not unregister %s: %s", rec.path, exc)
