"""How the planner changes the fleet: a `Connector` turns a decision (workers per role) into
running workers. The planner only ever talks to this interface; the connectors that start
processes, patch Kubernetes Deployments or hand decisions to an outside orchestrator live in
their own modules and register here by name.

Roles: "agg" (aggregated workers), "prefill", "decode". A decision names only the roles the
planner's mode manages; a connector refuses a role it cannot scale (`ValueError`)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import pkgutil
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable

Role = Literal["agg", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("agg", "prefill", "decode")

log = logging.getLogger("turbine.planner")


@runtime_checkable
class Connector(Protocol):
    """What the planner needs of whoever runs the workers.

    - `start()` once before any other call (connect, find what it manages).
    - `current_replicas()`: role -> workers of that role that are up and serving (ready), as the
      connector sees them. A role the connector does not manage is absent.
    - `starting_replicas()`: role -> workers asked for (by a decision) that are not ready yet:
      capacity to come. The planner counts them as capacity, so it does not ask again for a worker
      that is only still starting (start-up takes seconds for a mocker, minutes for vLLM).
    - `set_replicas(targets, decision_id)`: make each named role have that many workers. Returns
      once the change is applied or acknowledged (a scale-down only after the removed workers have
      drained: no request may fail because of it); raises on failure. `decision_id` grows by one per
      decision, so an outside party can tell decisions apart and acknowledge the one it applied.
    - `close()`: release what `start()` took; the workers it started may stay or go (its docs say).

    Optional, for a connector that keeps a sleeping pool (the planner reads them when present):
    `sleeping_replicas()` (async): role -> workers asleep, woken first on a step up; `pool_capacity()`:
    role -> the most it keeps asleep (a step down puts workers to sleep up to it before stopping any).
    The planner's maths then know two delays: a wake and a start-up (planner.py).
    """

    async def start(self) -> None: ...

    async def current_replicas(self) -> dict[str, int]: ...

    async def starting_replicas(self) -> dict[str, int]: ...

    async def set_replicas(self, targets: dict[str, int], decision_id: int) -> None: ...

    async def close(self) -> None: ...


class AdvisoryConnector:
    """`--advisory`: log each decision, change nothing. It reports the counts it is given by
    `observe` (the planner feeds it the workers it sees in discovery), so decisions are computed
    against the real fleet."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self.decisions: list[tuple[int, dict[str, int]]] = []  # (decision_id, targets), newest last

    def observe(self, counts: dict[str, int]) -> None:
        self._seen = dict(counts)

    async def start(self) -> None:
        return None

    async def current_replicas(self) -> dict[str, int]:
        return dict(self._seen)

    async def starting_replicas(self) -> dict[str, int]:
        return {}  # it starts nothing

    async def set_replicas(self, targets: dict[str, int], decision_id: int) -> None:
        self.decisions.append((decision_id, dict(targets)))
        log.info("advisory: decision %d would set %s (now %s); nothing changed", decision_id,
                 targets, self._seen)

    async def close(self) -> None:
        return None


# Connectors by name. A connector module is `turbine/planner/connectors/NAME.py` and calls
# `register_connector("NAME", factory)` when imported; `--connector NAME` imports it on demand, so a
# connector's own dependencies (the kubernetes client ...) load only when it is chosen.
ConnectorFactory = Callable[..., Connector]
_CONNECTORS: dict[str, ConnectorFactory] = {}


def register_connector(name: str, factory: ConnectorFactory) -> None:
    """Make `--connector name` build `factory(config)` (config: the planner's `PlannerConfig`)."""
    _CONNECTORS[name] = factory


def connector_names() -> tuple[str, ...]:
    """"advisory" plus every module in turbine/planner/connectors/ (found without importing them)."""
    names = set(_CONNECTORS)
    with contextlib.suppress(ModuleNotFoundError):
        import turbine.planner.connectors as pkg

        names.update(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return ("advisory", *sorted(names - {"advisory"}))


def make_connector(name: str, config: object) -> Connector:
    if name == "advisory":
        return AdvisoryConnector()
    if name not in _CONNECTORS and name in connector_names():
        importlib.import_module(f"turbine.planner.connectors.{name}")
    try:
        factory = _CONNECTORS[name]
    except KeyError:
        raise ValueError(f"unknown connector {name!r}; choose from {', '.join(connector_names())}") from None
    return factory(config)
