"""The LoRA adapters resident in an engine's active slots: an LRU of `capacity` names.

vLLM keeps the adapters of the running batch in `max_loras` GPU slots; an adapter the batch
needs that is not in a slot is copied into the least recently used one (a swap). Workers report
the slots' contents in their load reports (LoadMetrics.active_loras), so that a router prefers
a worker that already has a request's adapter active.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoraSlots:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.swaps = 0  # adapters brought into a slot (each one a load the engine pays for)

    def __contains__(self, name: str) -> bool:
        return name in self._lru

    def touch(self, names: Iterable[str]) -> int:
        """These adapters are used now (most recently the last); returns how many of them had to be
        swapped in. Give at most `capacity` names at once: more cannot be active together."""
        swapped = 0
        for name in names:
            if name in self._lru:
                self._lru.move_to_end(name)
                continue
            if len(self._lru) >= self.capacity:
                if not self.capacity:
                    continue
                self._lru.popitem(last=False)
            self._lru[name] = None
            swapped += 1
        self.swaps += swapped
        return swapped

    def discard(self, name: str) -> None:
        """The adapter was unloaded from the engine: its slot is free."""
        self._lru.pop(name, None)

    @property
    def resident(self) -> tuple[str, ...]:
        """The adapters in the slots, least recently used first."""
        return tuple(self._lru)
