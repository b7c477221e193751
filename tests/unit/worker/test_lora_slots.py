"""The LRU of an engine's active LoRA slots: what workers report, and what the mocker swaps."""

from __future__ import annotations

import pytest

from turbine.worker.lora_slots import LoraSlots


def test_an_lru_of_the_slots_counts_swaps():
    slots = LoraSlots(2)
    assert slots.touch(["a", "b"]) == 2 and slots.resident == ("a", "b")
    assert slots.touch(["a"]) == 0 and slots.resident == ("b", "a")  # a is the most recent now
    assert slots.touch(["c"]) == 1 and slots.resident == ("a", "c")  # b, least recently used, leaves
    assert "c" in slots and "b" not in slots and slots.swaps == 3
    slots.discard("a")
    assert slots.resident == ("c",)


def test_no_slots_hold_nothing():
    slots = LoraSlots(0)
    assert slots.touch(["a"]) == 0 and slots.resident == ()
    with pytest.raises(ValueError):
        LoraSlots(-1)
