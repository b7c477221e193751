"""Checkpoint / restore of a worker process, driven by marker files in a control directory
(TURBINE_SNAPSHOT_CONTROL_DIR), as Dynamo's snapshot agent drives its workers:

1. the worker builds its engine before opening any socket (no status server, event plane,
   discovery or request plane yet), then quiesces it (nothing running, nothing cached: the
   mocker and vLLM on a GPU sleep, vLLM on CPU pauses, drains and resets its caches);
2. it writes `ready-for-checkpoint`: an outside agent may now dump the process (e.g. CRIU);
3. it polls every 100 ms for the agent's answer:
   - `snapshot-complete`: the checkpoint is taken; the worker exits 0, never having registered;
   - `restore-complete`: this is a restored copy; it wakes the engine, takes its identity
     (namespace, component, instance id) from the restore context, then opens its sockets,
     registers and serves like any worker.
The markers are removed once answered. A restored process keeps the environment it had at
checkpoint time, so its new identity comes from `restore-context.json` in the control directory
(written by whoever restores it: {"version": 1, "env": {"TURBINE_NAMESPACE": ..., ...}}), or
from the environment when there is none."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("turbine.worker")

SNAPSHOT_CONTROL_DIR_ENV = "TURBINE_SNAPSHOT_CONTROL_DIR"
READY_FOR_CHECKPOINT = "ready-for-checkpoint"
SNAPSHOT_COMPLETE = "snapshot-complete"
RESTORE_COMPLETE = "restore-complete"
RESTORE_CONTEXT = "restore-context.json"
POLL_S = 0.1  # checkpoints take seconds: 100 ms of polling costs nothing

# What a restore may change: the identity the restored worker registers under.
IDENTITY_ENV = {"namespace": "TURBINE_NAMESPACE", "component": "TURBINE_COMPONENT",
                "instance_id": "TURBINE_INSTANCE_ID"}


class SnapshotError(Exception):
    """The control directory or the restore context is unusable (the message names it)."""


@dataclass(frozen=True)
class RestoredIdentity:
    """Where a restored worker registers; None keeps what it was started with."""

    namespace: str | None = None
    component: str | None = None
    instance_id: str | None = None


class SnapshotControl:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    @classmethod
    def from_env(cls) -> SnapshotControl | None:
        value = os.environ.get(SNAPSHOT_CONTROL_DIR_ENV)
        if not value:
            return None
        if not os.path.isdir(value):
            raise SnapshotError(f"{SNAPSHOT_CONTROL_DIR_ENV}={value!r}: no such directory")
        return cls(value)

    def ready(self) -> None:
        """Announce that the process may be checkpointed (written whole: a rename)."""
        tmp = self.dir / f".{READY_FOR_CHECKPOINT}.tmp"
        tmp.write_text("ready")
        tmp.replace(self.dir / READY_FOR_CHECKPOINT)

    async def wait(self) -> str:
        """SNAPSHOT_COMPLETE or RESTORE_COMPLETE, whichever appears (snapshot wins a tie)."""
        while True:
            for marker in (SNAPSHOT_COMPLETE, RESTORE_COMPLETE):
                if (self.dir / marker).exists():
                    return marker
            await asyncio.sleep(POLL_S)

    def clear(self) -> None:
        for name in (READY_FOR_CHECKPOINT, SNAPSHOT_COMPLETE, RESTORE_COMPLETE):
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass

    def restored_identity(self) -> RestoredIdentity:
        """The identity from the restore context (applied to os.environ too), else the environment."""
        path = self.dir / RESTORE_CONTEXT
        if path.is_file():
            try:
                context = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise SnapshotError(f"{path}: not JSON ({exc})") from None
            env = context.get("env") if isinstance(context, dict) else None
            if not isinstance(context, dict) or context.get("version") != 1 or not isinstance(env, dict):
                raise SnapshotError(f'{path}: expected {{"version": 1, "env": {{...}}}}')
            for name, value in env.items():
                if name not in IDENTITY_ENV.values():
                    log.warning("%s: %s ignored (a restore sets only %s)", path, name, ", ".join(IDENTITY_ENV.values()))
                elif value is None:
                    os.environ.pop(name, None)
                elif isinstance(value, str):
                    os.environ[name] = value
                else:
                    raise SnapshotError(f"{path}: env.{name} must be a string or null")
        return RestoredIdentity(**{field: os.environ.get(name) or None for field, name in IDENTITY_ENV.items()})
