"""TieredStore: write-through, fastest-first lookup with promotion, per-tier and consolidated events."""

from turbine.kvbm import Block, BlockEvent, DiskStore, HostStore, SharedStore, TieredStore, TierEvent
from turbine.kvbm.block import HEADER_SIZE


def blk(h: int, parent: int | None = None) -> Block:
    return Block(h, parent, 16, bytes([h % 256]) * 100)


def three(tmp_path, host_blocks=2, disk_blocks=3, shared_blocks=100):
    per_file = 100 + HEADER_SIZE
    return TieredStore([HostStore(host_blocks * 100), DiskStore(str(tmp_path / "d"), disk_blocks * per_file),
                        SharedStore(str(tmp_path / "s"), shared_blocks * per_file)])


def sample(store, name, tier=None):
    return store.metrics.registry.get_sample_value(name, {"tier": tier} if tier else {}) or 0


def test_write_through_every_tier(tmp_path):
    s = three(tmp_path)
    assert s.put(blk(1)) == ["host", "disk", "shared"]
    assert s.tiers_of(1) == {"host", "disk", "shared"}
    assert s.take_tier_events() == [TierEvent("stored", t, 1) for t in ("host", "disk", "shared")]
    assert s.take_events() == [BlockEvent("stored", "host", 1, None)]  # one, from the tier it appeared in first
    assert s.put(blk(1)) == ["host", "disk", "shared"] and s.take_events() == []  # again: nothing new
    for t in ("host", "disk", "shared"):
        assert sample(s, "turbine_kvbm_blocks_stored_total", t) == 1
        assert sample(s, "turbine_kvbm_bytes_written_total", t) == 100
        assert sample(s, "turbine_kvbm_write_seconds_total", t) > 0  # timed, each tier on its own
    assert sample(s, "turbine_kvbm_read_seconds_total", "host") == 0
    s.get(1)
    assert sample(s, "turbine_kvbm_read_seconds_total", "host") > 0
    assert sample(s, "turbine_kvbm_read_seconds_total", "disk") == 0  # served by the host tier: not read


def test_lookup_fastest_first_and_promotion(tmp_path):
    s = three(tmp_path, host_blocks=2)
    for h in (1, 2, 3):
        s.put(blk(h, h - 1 or None))
    assert not s.tiers[0].contains(1)  # the host tier (2 blocks) evicted block 1; disk still has it
    assert s.locate(1) == "disk" and s.locate(3) == "host"
    assert s.match_prefix([1, 2, 3, 99, 3]) == ["disk", "host", "host"]
    s.take_events()
    got = s.get(1)
    assert got == (blk(1), "disk")
    assert s.tiers[0].contains(1)  # promoted: next time from memory
    assert s.get(1) == (blk(1), "host")
    assert sample(s, "turbine_kvbm_hits_total", "disk") == 1 and sample(s, "turbine_kvbm_hits_total", "host") == 1
    assert s.get(12345) is None and sample(s, "turbine_kvbm_misses_total") == 1
    # The host tier was cleared: the disk tier serves, then the shared one once disk lost it too.
    s.clear_tier("host")
    assert s.get(2) == (blk(2, 1), "disk")
    s.clear_tier("host")
    s.tiers[1].remove(2)
    assert s.get(2) == (blk(2, 1), "shared")
    assert s.tiers_of(2) >= {"host", "disk", "shared"}  # promoted into both faster tiers


def test_consolidated_events_removed_only_when_gone_from_all(tmp_path):
    s = three(tmp_path, host_blocks=1, disk_blocks=2, shared_blocks=100)
    s.put(blk(1))
    s.put(blk(2, 1))  # host evicts 1
    s.put(blk(3, 2))  # host evicts 2, disk evicts 1
    assert s.take_events() == [BlockEvent("stored", "host", 1), BlockEvent("stored", "host", 2, 1),
                               BlockEvent("stored", "host", 3, 2)]
    tier_events = s.take_tier_events()
    assert TierEvent("removed", "host", 1) in tier_events and TierEvent("removed", "disk", 1) in tier_events
    assert s.tiers_of(1) == {"shared"}
    s.tiers[2].remove(1)  # another worker evicted it from the shared tier ...
    assert s.take_events() == []
    assert s.get(1) is None  # ... noticed on the next miss: block 1 is gone from all tiers
    events = s.take_events()
    assert BlockEvent("removed", "shared", 1) in events
    s.clear_tier("disk")  # 2 and 3 stay in the shared tier
    events += s.take_events()
    assert not [e for e in events if e.kind == "removed" and e.block_hash in (2, 3)]  # still on disk
    assert sample(s, "turbine_kvbm_blocks_removed_total", "host") == 2


def test_shared_block_from_another_worker_appears_on_lookup(tmp_path):
    mine = three(tmp_path / "a")
    other = TieredStore([HostStore(1000), SharedStore(str(tmp_path / "a" / "s"), 1 << 20)])
    other.put(blk(7))
    assert mine.locate(7) == "shared"
    assert mine.get(7) == (blk(7), "shared")
    assert mine.take_events() == [BlockEvent("stored", "shared", 7, None)]
    mine.remove(7)
    assert mine.take_events() == [BlockEvent("removed", "shared", 7)]
    assert mine.get(7) is None and other.tiers[0].contains(7)


def test_corrupt_file_in_the_only_tier_removes_the_block(tmp_path):
    s = TieredStore([DiskStore(str(tmp_path / "d"), 1 << 20)])
    s.put(blk(5))
    s.take_events()
    path = s.tiers[0]._path(5)
    with open(path, "r+b") as f:
        f.truncate(HEADER_SIZE + 10)
    assert s.get(5) is None
    assert s.take_events() == [BlockEvent("removed", "disk", 5)]
    assert sample(s, "turbine_kvbm_corrupt_blocks_total", "disk") == 1


def test_full_tier_is_skipped_by_write_through(tmp_path):
    s = three(tmp_path)
    s.tiers[1]._writable = False  # as after a full disk (tested for real in test_file_safety)
    assert s.put(blk(1)) == ["host", "shared"]
    assert s.tiers_of(1) == {"host", "shared"}


def test_blocks_a_disk_tier_held_at_start_are_adopted_with_events(tmp_path):
    first = three(tmp_path)
    first.put(blk(1))
    first.put(blk(2, 1))
    # A new process over the same directories (a restart): the disk tier's index has both blocks.
    again = TieredStore([HostStore(200), DiskStore(str(tmp_path / "d"), 10_000)])
    assert again.tiers_of(1) == frozenset()
    assert again.adopt_held() == 2
    assert again.tiers_of(1) == {"disk"} and again.tiers_of(2) == {"disk"}
    assert again.take_tier_events() == [TierEvent("stored", "disk", 1), TierEvent("stored", "disk", 2)]
    again.remove(1)  # its removal is now reported
    assert again.take_events()[-1] == BlockEvent("removed", "disk", 1)


def test_frequency_filter_writes_a_tier_only_blocks_used_often_enough(tmp_path):
    s = TieredStore([HostStore(2 * 100), DiskStore(str(tmp_path / "d"), 100 * (100 + HEADER_SIZE))],
                    min_uses={"disk": 2})
    assert s.put(blk(1)) == ["host"]  # computed once: not worth a disk write yet
    assert not s.tiers[1].contains(1) and sample(s, "turbine_kvbm_writes_filtered_total", "disk") == 1
    assert s.get(1) == (blk(1), "host")  # its second use: now written to disk
    assert s.tiers[1].contains(1) and s.tiers_of(1) == {"host", "disk"}
    assert sample(s, "turbine_kvbm_bytes_written_total", "disk") == 100
    # A block computed twice (it left every tier in between) is written on its second put.
    s.put(blk(2))
    s.put(blk(3))
    s.put(blk(4))  # the host tier (2 blocks) dropped 2
    assert s.locate(2) is None
    assert s.put(blk(2)) == ["host", "disk"]
    # Promotion from disk into the host tier is unfiltered; a block used once stays off disk.
    s.clear_tier("host")
    assert s.get(1) == (blk(1), "disk") and s.tiers[0].contains(1)
    assert not s.tiers[1].contains(3) and not s.tiers[1].contains(4)


def test_no_filter_writes_every_block_and_min_uses_is_checked(tmp_path):
    s = TieredStore([HostStore(200), DiskStore(str(tmp_path / "d"), 10_000)], min_uses={"disk": 1})
    assert s.put(blk(1)) == ["host", "disk"]
    for bad in ({"disk": 0}, {"shared": 2}):
        try:
            TieredStore([HostStore(200)], min_uses=bad)
        except ValueError as e:
            assert "min_uses" in str(e)
        else:
            raise AssertionError(f"accepted {bad}")


def test_get_many_reads_in_parallel_and_leaves_the_tiers_as_one_get_at_a_time(tmp_path):
    """The vLLM connector reads one step's file-tier blocks on a thread pool: the answers, the promotions into
    the host tier and its recency order must be those of sequential gets, whatever order the reads finish in."""
    from concurrent.futures import ThreadPoolExecutor

    from turbine.kvbm import DiskStore, HostStore, TieredStore

    def store(name):
        return TieredStore([HostStore(3 * 100, "host"), DiskStore(str(tmp_path / name), 1 << 20)])

    blocks = [Block(h, None, 16, bytes([h]) * 100) for h in range(1, 7)]
    one, many = store("one"), store("many")
    for s in (one, many):
        for b in blocks:
            s.put(b)  # the host tier keeps the last three; the disk tier all six
    wanted = [1, 2, 6, 3, 99]
    sequential = [one.get(h) for h in wanted]
    with ThreadPoolExecutor(4) as pool:
        parallel = many.get_many(wanted, pool.map)
    assert [(bytes(b.data), t) if r else None for r in parallel for b, t in [r or (None, None)]] == \
        [(bytes(b.data), t) if r else None for r in sequential for b, t in [r or (None, None)]]
    assert [t for _, t in filter(None, parallel)] == ["disk", "disk", "host", "disk"]
    # The host tier now holds the last three read, in the same recency order as after the sequential gets.
    assert list(many.tiers[0]._blocks) == list(one.tiers[0]._blocks) == [2, 6, 3]


def test_put_many_leaves_the_tiers_events_and_counts_as_puts_one_at_a_time(tmp_path):
    """put_many (a step's blocks, each tier taking its share together) against put of each block: the same tiers
    hold the same blocks, the same per-tier events (evictions included), the same counts, the frequency filter
    alike. The consolidated stream may show a block the host tier evicted within the batch as removed and then
    stored again by the disk tier: it ends in the same blocks."""
    blocks = [blk(1), blk(2, 1), blk(3, 2), blk(2, 1), blk(4, 3)]
    results = []
    for name, write in (("one", lambda s: [s.put(b) for b in blocks]), ("many", lambda s: s.put_many(blocks))):
        s = three(tmp_path / name)
        s.min_uses = {"shared": 2}
        held = write(s)
        held_after = set()
        for e in s.take_events():
            (held_after.add if e.kind == "stored" else held_after.discard)(e.block_hash)
        results.append((held, s.take_tier_events(), held_after,
                        [sorted(s.tiers_of(h)) for h in range(1, 5)],
                        [(sample(s, m, t)) for m in ("turbine_kvbm_blocks_stored_total",
                                                     "turbine_kvbm_blocks_removed_total",
                                                     "turbine_kvbm_writes_filtered_total")
                         for t in ("host", "disk", "shared")]))
    one, many = results
    assert one[0] == many[0] and one[3] == many[3] and one[4] == many[4]
    assert sorted(one[1], key=repr) == sorted(many[1], key=repr)  # per tier the same events; tier by tier in order
    assert one[2] == many[2] == {2, 3, 4}
    assert many[0][3] == ["host", "disk", "shared"]  # the second put of 2 reached the filtered tier
