"""--connector kvbm on a real vLLM CPU engine with a deliberately small KV cache: a long prompt pushed
out of the engine comes back from the host tier, then (pushed out of the host tier too) from the
disk tier, with the same greedy text as its first, fresh computation and the engine counting the
tokens as external-cache hits by tier; a corrupted block file is found before it is offered to the engine,
and its tokens computed fresh. A second
worker that shares the first's shared tier (its own discovery and frontend, so each request goes
where the test sends it) onboards a prompt the first computed.

The second worker is a prefill worker with `--connector kvbm nixl` (vLLM's MultiConnector) in front of
a decode worker (`--connector nixl`): its frontend sends every prompt through it, so what it onboards
from its tiers reaches the decode worker over NIXL with the rest of the prompt's KV.

Three engines for the module (the second and third only for what needs a second worker), with 32-token
blocks (the CPU build's default is 128; smaller prompts keep the test short). Each prompt is 112 token
ids: 3 full blocks (what is offloaded) and a partial one, so 4 engine blocks with its output. The
engine holds 7 blocks (6 usable: vLLM keeps one as its null block), the host tier 6.5 blocks' bytes
(two prompts). vLLM evicts the least recently freed blocks first, the tail of a request before its
head; the comments count blocks."""

from __future__ import annotations

import asyncio
import os
import random
import re
import time

import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    mp_layout,
    prefill_workers_of,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.integration.test_disagg_vllm import clear_cache, worker_metric
from turbine.kvbm.block import HEADER_SIZE, decode, file_name
from turbine.router.hashing import block_hashes

BLOCK = 32
FULL = 3
PROMPT_LEN = FULL * BLOCK + 16
BLOCK_BYTES = 30 * 3 * BLOCK * 128 * 4  # SmolLM2-135M, float32: layers × KV heads × tokens × (K+V head dims) × 4
HOST_GB = 6.5 * BLOCK_BYTES / 2**30
# The file tiers hold 24 blocks each (what the tests before the last one write fits), so that five long
# prompts push a prompt out of every tier.
FILE_GB = 24 * (BLOCK_BYTES + HEADER_SIZE) / 2**30
LONG_LEN = 5 * BLOCK + 16  # 5 full blocks: with its output, the engine's 6 usable blocks


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


@pytest.fixture(scope="module")
def kvbm(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("kvbm")
    env = mp_layout(base_env(str(root / "discovery")))  # the connectors' worker halves in vLLM CPU's own layout
    env_b = mp_layout(base_env(str(root / "discovery-b")))  # the connectors' worker halves in vLLM CPU's own layout
    disk, shared = root / "kv-disk", root / "kv-shared"
    small_engine = ("--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "192",  # the 6 usable blocks
                    "--num-gpu-blocks-override", "7")
    tiers = ("--kv-host-cache-gb", f"{HOST_GB:.9f}", "--kv-shared-cache-gb", f"{FILE_GB:.9f}",
             "--kv-shared-cache-dir", str(shared))
    worker = start_worker("kvbm-worker", env, root, *small_engine, "--connector", "kvbm", *tiers,
                          "--kv-disk-cache-gb", f"{FILE_GB:.9f}", "--kv-disk-cache-dir", str(disk))
    worker_b = start_worker("kvbm-prefill-b", env_b, root, *small_engine, "--is-prefill-worker",
                            "--connector", "kvbm", "nixl", *tiers)
    decode_b = start_worker("kvbm-decode-b", env_b, root, *small_engine, "--disaggregation-mode", "decode",
                            "--connector", "nixl")
    frontend = start_frontend("kvbm-frontend", env, root)
    # Every prompt through the prefill worker.
    frontend_b = start_frontend("kvbm-frontend-b", env_b, root, "--max-local-prefill-length", "0")
    procs = [worker, worker_b, decode_b, frontend, frontend_b]
    try:
        for w in (worker, worker_b, decode_b):
            wait_until(lambda: worker_ready(w), ENGINE_START_TIMEOUT, f"{w.name} ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "kvbm-frontend sees its worker", procs)
        wait_until(lambda: instances_of(frontend_b, MODEL) == 1 and prefill_workers_of(frontend_b, MODEL) == 1, 30,
                   "kvbm-frontend-b sees its decode and prefill workers", procs)
        yield {"worker": worker, "client": _client(frontend), "disk": disk, "shared": shared,
               "b": {"worker": worker_b, "decode": decode_b, "client": _client(frontend_b)},
               "discovery": [env, env_b]}
    finally:
        stop_all(procs)


def _client(frontend) -> OpenAI:
    return OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)


def cached_by_source(worker) -> dict[str, float]:
    """vLLM's cached prompt tokens by source, and the tiers' own counters (`turbine_kvbm_*_total`,
    counted in the model-runner process) as "family/tier", both from the worker's /metrics.

    vLLM 0.32 counts cached tokens by source (device, host, disk, external_unspecified: the connector's
    `get_external_cache_hit_sources`). 0.26 (the GPU release, where this module also runs:
    benchmarks/gpu/gpu_tests.sh) has no such counter: there the engine's own hits are its prefix-cache hits and
    each tier's tokens are the blocks the connector loaded from it; vLLM's external total is counted in both."""
    out: dict[str, float] = {}
    text = http_text(f"{worker.url}/metrics")
    by_source = False
    for line in text.splitlines():
        if m := re.match(r'vllm:prompt_tokens_cached_by_source_total\{.*source="([a-z_]+)".*\} (\S+)', line):
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
            by_source = True
        elif m := re.match(r'turbine_kvbm_([a-z_]+)_total\{(?:.*tier="([a-z]+)")?.*\} (\S+)', line):
            key = f"{m[1]}/{m[2]}" if m[2] else m[1]
            out[key] = out.get(key, 0.0) + float(m[3])
    out["external"] = metric(text, "vllm:external_prefix_cache_hits_total")
    if not by_source:
        out["device"] = metric(text, "vllm:prefix_cache_hits_total")
        for tier, source in (("host", "host"), ("disk", "disk"), ("shared", "external_unspecified")):
            out[source] = out.get(f"hits/{tier}", 0.0) * BLOCK
    return out


def run(kvbm, tokens: list[int]) -> tuple[str, dict[str, float]]:
    """The greedy text and what the engine counted as cached, by source, for this request."""
    before = cached_by_source(kvbm["worker"])
    r = kvbm["client"].completions.create(model=MODEL, prompt=tokens, max_tokens=4, temperature=0)
    # Counted at admission: that step's stats reached /metrics steps before the request's last token.
    after = cached_by_source(kvbm["worker"])
    return r.choices[0].text, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after | before}


def block_files(kvbm, tokens: list[int], tier: str = "disk") -> list[str]:
    """The disk (or shared) tier's file of each full block, named by the router's block hash."""
    (layout,) = [d for d in os.listdir(kvbm[tier]) if os.path.isdir(os.path.join(kvbm[tier], d))]  # one layout
    return [os.path.join(kvbm[tier], layout, file_name(h)) for h in block_hashes(tokens[:FULL * BLOCK], BLOCK)]


def flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 1000)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_offloaded_prompt_comes_back_from_host_then_disk_and_a_corrupt_block_is_recomputed(kvbm):
    a = prompt(1)
    fresh, counted = run(kvbm, a)
    assert counted["external"] == 0
    # Offloaded as computed, each block under the router's hash of it.
    assert all(os.path.exists(f) for f in block_files(kvbm, a))
    # ... and counted on the worker's /metrics (from the model-runner process, through vLLM's connector stats).
    assert counted["blocks_stored/host"] == FULL and counted["blocks_stored/disk"] == FULL, counted
    assert counted["bytes_written/disk"] == FULL * BLOCK_BYTES and counted.get("hits/host", 0) == 0
    # The engine's steps: time handing blocks to the tiers after the forward pass, none loading (nothing to load).
    assert counted["step_save_seconds"] > 0 and counted.get("step_load_seconds", 0) == 0, counted
    disk_used = [float(line.rsplit(" ", 1)[1]) for line in http_text(f"{kvbm['worker'].url}/metrics").splitlines()
                 if line.startswith("turbine_kvbm_tier_used_bytes{") and 'tier="disk"' in line]
    assert disk_used and disk_used[0] >= FULL * BLOCK_BYTES

    # Host tier: B takes A's last full block's engine slot; all of A is still in host memory.
    run(kvbm, prompt(2))
    text, counted = run(kvbm, a)
    assert text == fresh
    assert counted["device"] == 2 * BLOCK and counted["host"] == BLOCK, counted
    assert counted["external"] == BLOCK and counted["disk"] == 0
    assert counted["hits/host"] == 1 and counted["bytes_read/host"] == BLOCK_BYTES, counted  # onboarded
    assert counted.get("hits/disk", 0) == 0

    # Disk tier: C and D push A out of the engine and out of the host tier (least recently used).
    run(kvbm, prompt(3))
    run(kvbm, prompt(4))
    text, counted = run(kvbm, a)
    assert text == fresh
    assert counted["disk"] == FULL * BLOCK and counted["external"] == FULL * BLOCK, counted
    assert counted["device"] == 0 and counted["host"] == 0
    assert counted["hits/disk"] == FULL and counted["bytes_read/disk"] == FULL * BLOCK_BYTES, counted
    assert counted["blocks_stored/host"] >= FULL  # promoted into the host tier as they were read
    assert counted["read_seconds/disk"] > 0 and counted["write_seconds/host"] > 0  # transfer time, per tier
    assert counted["step_load_seconds"] > 0  # the step that loaded them, before its forward pass

    # A corrupt block file: E and F push A out again; A's block 1 gets one payload byte flipped in both
    # file tiers (the disk tier's copy alone would be offered from the shared tier instead).
    run(kvbm, prompt(5))
    run(kvbm, prompt(6))
    bad = block_files(kvbm, a)[1]
    flip_a_byte(bad)
    flip_a_byte(block_files(kvbm, a, "shared")[1])
    text, counted = run(kvbm, a)
    # The scheduler half checked the files before offering them: block 0 offered (and loaded) from disk, block 1
    # found corrupt in both tiers and never offered, so blocks 1 and 2 computed fresh; no load failed (a failed
    # load is what vLLM 0.26 on a GPU does not survive).
    assert counted["external"] == BLOCK and counted["disk"] == BLOCK, counted
    assert counted["hits/disk"] == 1 and counted["bytes_read/disk"] == BLOCK_BYTES, counted
    assert counted.get("hits/shared", 0) == 0 and counted.get("load_errors", 0) == 0, counted
    assert counted["corrupt_blocks/disk"] == 1 and counted["corrupt_blocks/shared"] == 1, counted
    assert text == fresh
    # The bad file was dropped and the recomputed block written again, whole.
    with open(bad, "rb") as f:
        assert decode(f.read(), block_hashes(a[:2 * BLOCK], BLOCK)[1]).num_tokens == BLOCK


def test_a_second_worker_onboards_from_the_shared_tier_what_the_first_computed(kvbm):
    g = prompt(7)
    fresh, counted = run(kvbm, g)  # worker A computes it: its full blocks go to every tier, the shared one too
    assert counted["external"] == 0 and counted["blocks_stored/shared"] == FULL, counted
    assert all(os.path.exists(f) for f in block_files(kvbm, g, "shared"))
    # Worker B never saw it: its scheduler half finds the blocks by probing the shared directory.
    text, counted = run(kvbm["b"], g)
    assert text == fresh
    assert counted["external"] == FULL * BLOCK and counted["external_unspecified"] == FULL * BLOCK, counted
    assert counted.get("device", 0) == 0 and counted.get("host", 0) == 0, counted
    assert counted["hits/shared"] == FULL and counted["bytes_read/shared"] == FULL * BLOCK_BYTES, counted
    assert counted["blocks_stored/host"] == FULL  # promoted into B's host tier as they were read


def test_a_prefill_worker_onboards_from_its_host_tier_and_hands_the_kv_to_decode_over_nixl(kvbm):
    """`--connector kvbm nixl` on the prefill worker: a long prompt evicted from its engine comes back from
    its host tier, and the decode worker still takes the whole prompt's KV over NIXL (computing at most
    the last token): the same greedy text as an aggregated worker's fresh computation, every time."""
    b, decode = kvbm["b"]["worker"], kvbm["b"]["decode"]
    kv_source = "vllm:prompt_tokens_by_source_total"

    def pulled_and_computed() -> tuple[float, float]:
        return (worker_metric(decode, kv_source, source="external_kv_transfer"),
                worker_metric(decode, kv_source, source="local_compute"))

    p = prompt(50, LONG_LEN)
    aggregated, counted = run(kvbm, p)  # worker A computes it, aggregated (and writes it to the shared tier)
    assert counted["external"] == 0
    # Through the prefill worker: its tiers onboard the prompt (from the shared tier: it never saw it).
    pulled_before, computed_before = pulled_and_computed()
    text, counted = run(kvbm["b"], p)
    assert text == aggregated
    assert counted["hits/shared"] == LONG_LEN // BLOCK, counted
    assert pulled_and_computed()[0] - pulled_before == LONG_LEN  # the decode worker took it over NIXL

    # A second prompt through the pair pushes p's tail out of the prefill engine; the host tier still has p
    # (promoted there as it was read). The decode engine forgets p too, so that it must pull all of it.
    run(kvbm["b"], prompt(51))
    clear_cache(decode)
    pulled_before, computed_before = pulled_and_computed()
    text, counted = run(kvbm["b"], p)
    assert text == aggregated
    onboarded = counted["hits/host"]
    assert onboarded >= 1 and counted["bytes_read/host"] == onboarded * BLOCK_BYTES, counted  # kvbm's onboard
    assert counted["host"] == onboarded * BLOCK and counted["external"] == onboarded * BLOCK, counted
    assert counted["device"] + counted["host"] == LONG_LEN // BLOCK * BLOCK, counted  # engine + host: every block
    pulled, computed = (after - before for after, before in zip(pulled_and_computed(),
                                                                (pulled_before, computed_before)))
    assert pulled == LONG_LEN and computed <= 1, (pulled, computed)  # over NIXL, onboarded blocks included


async def test_the_router_follows_the_tiers_consolidated_stream(kvbm):
    """The router's index, fed by the real workers' KV events: a prompt the engine evicted but the tiers
    hold still draws the request to worker A (and, through the shared tier, to B, which sees it too) rather
    than to a worker holding nothing; gone from every tier, it is gone from the index."""
    from turbine.config import DiscoveryConfig, make_registry
    from turbine.router.config import KvRouterConfig
    from turbine.router.cost import WorkerLoad
    from turbine.router.indexer import WorkerKey
    from turbine.router.model_router import ModelKvRouter

    cards, addresses = {}, {}
    for env in kvbm["discovery"]:
        registry = make_registry(DiscoveryConfig(backend="file", file_dir=env["TURBINE_DISCOVERY_DIR"]))
        await registry.backend.start()
        try:
            found = [c for c in await registry.list_models()
                     if c.name == MODEL and c.lora_name is None and c.disaggregation_mode != "decode"]
            addresses.update({r.instance_id: r.address for r in await registry.list_instances()})
        finally:
            await registry.backend.close()
        assert len(found) == 1
        cards[found[0].instance_id] = found[0]
    a_id, b_id = (c.instance_id for c in cards.values())
    assert cards[a_id].kv_shared_tier and cards[a_id].kv_shared_tier == cards[b_id].kv_shared_tier
    router = ModelKvRouter(MODEL, KvRouterConfig(), BLOCK)
    router.instances_changed(cards, addresses)
    index = router.kv.index
    a, cold = WorkerKey(a_id), "cold-worker"  # a worker that holds nothing, to compare with
    h = prompt(8)
    hashes = block_hashes(h[:FULL * BLOCK], BLOCK)

    async def until(cond, what):
        for _ in range(200):
            if cond():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    async def costs():
        # Once both workers report no load (their reports come on change and every 5 s), only caches differ.
        await until(lambda: all(router.kv.loads.load(w) == WorkerLoad() for w in (a, WorkerKey(b_id))), "idle")
        return router.decide("probe", h, [a_id, b_id, cold], track=False).costs

    try:
        await asyncio.to_thread(run, kvbm, h)  # A computes it: in its engine and every tier
        await until(lambda: index.find_matches(hashes).get(a) == FULL, "the engine's blocks in the index")
        await until(lambda: index.tier_matches(hashes, [a], {}).get(a) == ["host"] * FULL, "the tiers' blocks")
        c = await costs()
        assert c[WorkerKey(a_id)] < c[WorkerKey(b_id)] < c[WorkerKey(cold)], c  # engine < shared tier < nothing

        # A long prompt evicts it from A's engine; the disk (and shared) tier still hold it.
        await asyncio.to_thread(run, kvbm, prompt(9, LONG_LEN))
        await until(lambda: not index.find_matches(hashes), "the engine's removals")
        assert all(os.path.exists(f) for f in block_files(kvbm, h))
        tiers = index.tier_matches(hashes, [a], {})[a]
        assert len(tiers) == FULL and "disk" in tiers, tiers  # the host tier made room for the long prompt's blocks
        c = await costs()
        assert min(c, key=c.get) in (WorkerKey(a_id), WorkerKey(b_id)) and c[WorkerKey(a_id)] < c[WorkerKey(cold)], c
        assert c[WorkerKey(b_id)] < c[WorkerKey(cold)], c  # the shared tier: B can load it too

        # Four more long prompts push it out of every tier: out of the index, for A and for B.
        for seed in range(10, 14):
            await asyncio.to_thread(run, kvbm, prompt(seed, LONG_LEN))
        assert not any(os.path.exists(f) for f in block_files(kvbm, h) + block_files(kvbm, h, "shared"))
        await until(lambda: not index.tier_matches(hashes, [a, WorkerKey(b_id)], {}), "the tiers' removals")
        c = await costs()
        assert c[WorkerKey(a_id)] == c[WorkerKey(b_id)] == c[WorkerKey(cold)], c
    finally:
        router.close()


def active_blocks(worker) -> float:
    return metric(http_text(f"{worker.url}/metrics"), "turbine_worker_active_kv_blocks")


def test_cancelling_a_stream_whose_prompt_is_being_onboarded_leaks_nothing(kvbm):
    """Loads run inside the engine's step (synchronously), so a cancel lands before the load is planned,
    between planning and the step, or after it: at each of several offsets the request is aborted, the
    engine's blocks return to none in use, the tiers stay whole (the prompt still comes back with its
    fresh text) and the worker keeps serving."""
    worker = kvbm["worker"]
    c = prompt(30)
    fresh, _ = run(kvbm, c)
    before = cached_by_source(worker)
    for i, delay in enumerate((0.0, 0.05, 0.2, 0.6)):
        run(kvbm, prompt(40 + i, LONG_LEN))  # pushes c out of the engine: its next request loads it from the tiers
        stream = kvbm["client"].completions.create(model=MODEL, prompt=c, max_tokens=50, temperature=0, stream=True)
        time.sleep(delay)
        stream.close()
        wait_until(lambda: active_blocks(worker) == 0, 60, "the engine frees the cancelled request's blocks", [worker])
    after = cached_by_source(worker)
    loaded = sum(after.get(k, 0) - before.get(k, 0) for k in ("hits/host", "hits/disk", "hits/shared"))
    assert loaded > 0  # some cancelled request had its blocks loaded before it was aborted
    text, _ = run(kvbm, c)
    assert text == fresh
    wait_until(lambda: active_blocks(worker) == 0, 60, "the engine idle again", [worker])
