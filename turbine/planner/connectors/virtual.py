"""The virtual connector: the planner decides, something outside Turbine (an orchestrator of your
own) starts and stops the workers.

Each decision goes into discovery (file or etcd, whichever the deployment uses) at
`planner/<namespace>/decision` as JSON `PlannerDecision{decision_id, targets, time}`;
set_replicas returns once the orchestrator has written `planner/<namespace>/ack` as JSON
`PlannerAck{decision_id}` with that decision's id or a later one, and raises TimeoutError after
`ack_timeout` seconds without. The workers that serve are counted from discovery: one per model
card of the namespace, by the card's role (`disaggregation_mode`). The orchestrator is the one to
stop a worker gracefully (SIGTERM: it unregisters and drains); see the README's Planner section.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from turbine.config import DEFAULT_NAMESPACE, ConfigError, DiscoveryConfig, check, make_registry
from turbine.planner.connector import ROLES, register_connector
from turbine.protocol.planner import PlannerAck, PlannerDecision, ack_key, decision_key

log = logging.getLogger("turbine.planner.virtual")


@dataclass(frozen=True)
class VirtualConnectorConfig:
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    namespace: str = DEFAULT_NAMESPACE
    ack_timeout: float = 600.0  # seconds set_replicas waits for the orchestrator's acknowledgement

    def __post_init__(self):
        check(self, bool(self.namespace) and "/" not in self.namespace, "namespace", "must be non-empty, no '/'")
        check(self, self.ack_timeout > 0, "ack_timeout", "must be > 0")

    @classmethod
    def from_dict(cls, options: dict, discovery: DiscoveryConfig | None = None,
                  namespace: str = DEFAULT_NAMESPACE) -> VirtualConnectorConfig:
        if bad := sorted(set(options) - {"ack_timeout"}):
            raise ConfigError(cls, "ack_timeout", f"unknown virtual connector option(s) {', '.join(bad)}")
        timeout = {"ack_timeout": float(options["ack_timeout"])} if "ack_timeout" in options else {}
        return cls(discovery=discovery or DiscoveryConfig(), namespace=namespace, **timeout)


class VirtualConnector:
    def __init__(self, cfg: VirtualConnectorConfig):
        self.cfg = cfg
        self.registry = make_registry(cfg.discovery)
        self.decision_key = decision_key(cfg.namespace)
        self.ack_key = ack_key(cfg.namespace)
        self.acked_targets: dict[str, int] = {}  # the last acknowledged decision's targets

    async def start(self) -> None:
        await self.registry.backend.start()

    async def current_replicas(self) -> dict[str, int]:
        counts = dict.fromkeys(ROLES, 0)
        for card in await self.registry.list_models():
            # (a sleeping worker's card stays, marked asleep: it serves nothing, so it is no replica)
            if card.namespace == self.cfg.namespace and card.disaggregation_mode in counts and not card.sleeping:
                counts[card.disaggregation_mode] += 1
        return counts

    async def starting_replicas(self) -> dict[str, int]:
        """Per role, how far the cards counted are below the last acknowledged decision (the
        orchestrator acknowledged it; its workers have not registered yet)."""
        counts = await self.current_replicas()
        return {r: max(0, n - counts.get(r, 0)) for r, n in self.acked_targets.items()}

    async def acknowledged(self) -> int | None:
        """The id of the latest decision the orchestrator acknowledged, None if none (or unreadable)."""
        raw = (await self.registry.backend.get_prefix(self.ack_key)).get(self.ack_key)
        return self._ack_id(raw)

    def _ack_id(self, raw: bytes | None) -> int | None:
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=PlannerAck).decision_id
        except msgspec.DecodeError as exc:
            log.warning("ignoring an unreadable acknowledgement at %s: %s", self.ack_key, exc)
            return None

    async def set_replicas(self, targets: dict[str, int], decision_id: int) -> None:
        if bad := sorted(set(targets) - set(ROLES)):
            raise ValueError(f"unknown role(s) {', '.join(bad)}; choose from {', '.join(ROLES)}")
        if bad := {r: t for r, t in targets.items() if t < 0}:
            raise ValueError(f"decision {decision_id}: negative target(s) {bad}")
        decision = PlannerDecision(decision_id=decision_id, targets=dict(targets), time=time.time())
        await self.registry.backend.put(self.decision_key, msgspec.json.encode(decision))
        log.info("decision %d written to %s: %s; waiting for its acknowledgement at %s", decision_id,
                 self.decision_key, targets, self.ack_key)
        try:
            async with asyncio.timeout(self.cfg.ack_timeout):
                async for snapshot in self.registry.backend.watch_prefix(self.ack_key):
                    acked = self._ack_id(snapshot.get(self.ack_key))
                    if acked is not None and acked >= decision_id:
                        log.info("decision %d acknowledged (ack %d)", decision_id, acked)
                        self.acked_targets.update(targets)
                        return
        except TimeoutError:
            raise TimeoutError(f"decision {decision_id} not acknowledged at {self.ack_key} within "
                               f"{self.cfg.ack_timeout:g}s") from None

    async def close(self) -> None:
        await self.registry.backend.close()  # the decision key goes with the planner's lease


def _from_planner_config(config: object) -> VirtualConnector:
    if isinstance(config, VirtualConnectorConfig):
        return VirtualConnector(config)
    return VirtualConnector(VirtualConnectorConfig.from_dict(
        getattr(config, "connector_options", None) or {}, getattr(config, "discovery", None),
        getattr(config, "namespace", None) or DEFAULT_NAMESPACE))


register_connector("virtual", _from_planner_config)
