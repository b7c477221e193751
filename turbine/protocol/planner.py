"""What the planner's virtual connector and an outside orchestrator exchange through discovery.

Keys (in the planner's namespace): `planner/<namespace>/decision` holds the planner's latest
`PlannerDecision` (under the planner's lease: it vanishes with the planner); the orchestrator
answers by writing `planner/<namespace>/ack`, a `PlannerAck` naming the decision it applied.
Both are JSON (msgspec), so an orchestrator in any language reads and writes them."""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1


def decision_key(namespace: str) -> str:
    return f"planner/{namespace}/decision"


def ack_key(namespace: str) -> str:
    return f"planner/{namespace}/ack"


class PlannerDecision(msgspec.Struct, kw_only=True):
    decision_id: int  # grows by one per decision
    targets: dict[str, int]  # role ("agg" | "prefill" | "decode") -> workers wanted
    time: float  # time.time() when decided
    v: int = WIRE_VERSION


class PlannerAck(msgspec.Struct, kw_only=True):
    decision_id: int  # the latest decision the orchestrator has applied
    v: int = WIRE_VERSION
