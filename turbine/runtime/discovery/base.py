"""The leased key-value store interface that discovery backends implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator


class DiscoveryBackend(ABC):
    """Keys written by a process live as long as that process's lease.

    Implementations keep the process's own keys in memory and re-publish them by
    themselves when the lease lapsed while the process was still alive (CPU starvation,
    backend briefly unreachable), so a live worker never stays invisible.
    """

    @abstractmethod
    async def start(self) -> None:
        """Acquire the lease and start keeping it alive."""

    @abstractmethod
    async def close(self) -> None:
        """Stop keeping the lease alive and remove this process's keys."""

    @abstractmethod
    async def put(self, key: str, value: bytes) -> None:
        """Create or replace `key`, attached to this process's lease."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove one of this process's keys (no error if absent)."""

    @abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """All live keys starting with `prefix`, from every process."""

    @abstractmethod
    def watch_prefix(self, prefix: str) -> AsyncIterator[dict[str, bytes]]:
        """Yield the full snapshot of `prefix` now, then again after every change."""

    async def __aenter__(self) -> DiscoveryBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
