"""Multi-node on one host (issue #30 §1): a leader worker fronting data-parallel ranks 0 and 1
(`--data-parallel-size 2 --data-parallel-size-local 1`) and a `--headless` node running rank 1's engine core,
joined over loopback (the data-parallel address), on real vLLM CPU engines.

- The node registers nothing: the frontend sees one instance, whose card counts both ranks; the node's
  `/health` and `/live` answer.
- The leader serves, and routes over both ranks: rank 1's engine (on the node) completes requests, and its KV
  events reach the KV router through the leader's relay (`--kv-events-port` on both); follow-ups of a long
  prompt land on the rank that holds its blocks, where the engine counts the hits.
- SIGTERM to the node ends it (exit 0) and the leader (its rank 1 gone: engine dead, unregistered, exit 3);
  SIGTERM to the leader of a second pair ends the leader (exit 0) and then the node.
Two engines per pair; the second pair only for the last case."""

from __future__ import annotations

import asyncio
import signal

import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    ENGINE_FLAGS,
    _start,
    base_env,
    free_port,
    http_json,
    http_text,
    instances_of,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.config import DiscoveryConfig, make_registry


def dp_flags(rpc_port: int, kv_port: int) -> list[str]:
    return ["--dtype", "float32", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
            "--kv-events-port", str(kv_port)]


def start_pair(name: str, root, env) -> dict:
    rpc, kv = free_port(), free_port()
    leader = start_worker(f"{name}-leader", env, root, *dp_flags(rpc, kv))
    node = _start(f"{name}-node", env, root, "turbine.vllm", "--system-port", *ENGINE_FLAGS, *dp_flags(rpc, kv),
                  "--headless", "--data-parallel-start-rank", "1")
    frontend = start_frontend(f"{name}-frontend", env, root, "--router-mode", "kv")
    procs = [leader, node, frontend]
    wait_until(lambda: worker_ready(node) and worker_ready(leader), ENGINE_START_TIMEOUT, "leader and node ready",
               procs)
    wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "the frontend sees the leader", procs)
    return {"leader": leader, "node": node, "frontend": frontend, "procs": procs, "discovery": env["TURBINE_DISCOVERY_DIR"]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("multi-node")
    env = base_env(str(root / "discovery"))
    state = None
    try:
        state = start_pair("a", root, env)
        yield state
    finally:
        stop_all(state["procs"] if state else [])


def cards(discovery_dir: str) -> list:
    async def read():
        registry = make_registry(DiscoveryConfig(backend="file", file_dir=discovery_dir))
        await registry.backend.start()
        try:
            return await registry.list_models()
        finally:
            await registry.backend.close()
    return asyncio.run(read())


def per_engine(worker, series: str) -> dict[str, float]:
    """A vLLM counter of the worker's /metrics by data-parallel rank (its `engine` label)."""
    out: dict[str, float] = {}
    for line in http_text(f"{worker.url}/metrics").splitlines():
        if line.startswith(series + "{"):
            engine = line.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def rank_key(pair, rank: str) -> str:
    """The router's name of one rank of the leader (`<instance>` for rank 0, `<instance>/<rank>` for others)."""
    (key,) = [w for w in indexed_by_worker(pair["frontend"]) if (w.rsplit("/", 1)[1] if "/" in w else "0") == rank]
    return key


def indexed_by_worker(frontend) -> dict[str, float]:
    out = {}
    for line in http_text(f"{frontend.url}/metrics").splitlines():
        if line.startswith("turbine_router_indexed_blocks{"):
            out[line.split('worker="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_node_registers_nothing_and_answers_health(pair):
    (card,) = cards(pair["discovery"])  # the leader's, alone
    assert card.data_parallel_size == 2
    assert http_json(f"{pair['node'].url}/health")[0] == 200
    assert http_json(f"{pair['node'].url}/live")[0] == 200


def test_the_leader_serves_on_both_ranks_and_rank_1s_kv_events_reach_the_router(pair):
    client = OpenAI(base_url=f"{pair['frontend'].url}/v1", api_key="x", max_retries=0, timeout=300)
    background = "A long background about lighthouses and the sea, repeated to fill blocks. " * 30
    for i in range(6):  # distinct prompts: the KV router spreads them by load over both ranks
        r = client.completions.create(model=MODEL, prompt=f"{i}: {background}", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    by_engine = per_engine(pair["leader"], "vllm:request_success_total")
    assert by_engine.get("0", 0) > 0 and by_engine.get("1", 0) > 0, by_engine
    wait_until(lambda: any(w.endswith("/1") and n > 0 for w, n in indexed_by_worker(pair["frontend"]).items()),
               20, "rank 1's blocks in the router's index", pair["procs"])


def test_a_repeated_long_prefix_lands_on_the_rank_that_holds_it(pair):
    """The KV router's per-rank state (fed by each rank's KV events, rank 1's from the other node) and the
    engines' own per-rank series agree: follow-ups of a long prompt go where its blocks are, and hit there."""
    client = OpenAI(base_url=f"{pair['frontend'].url}/v1", api_key="x", max_retries=0, timeout=300)
    prefix = "Tide tables: notes on currents and the pull of the moon, long enough to fill many blocks. " * 25
    before = per_engine(pair["leader"], "vllm:request_success_total")
    client.completions.create(model=MODEL, prompt=prefix + "First question.", max_tokens=2, temperature=0)
    after = per_engine(pair["leader"], "vllm:request_success_total")
    (rank,) = [e for e in after if after[e] > before.get(e, 0)]
    wait_until(lambda: indexed_by_worker(pair["frontend"]).get(rank_key(pair, rank), 0) > 0, 20,
               f"rank {rank}'s blocks in the router's index", pair["procs"])
    hits0 = per_engine(pair["leader"], "vllm:prefix_cache_hits_total")
    for i in range(3):
        client.completions.create(model=MODEL, prompt=prefix + f"Follow-up {i}.", max_tokens=2, temperature=0)
    served = per_engine(pair["leader"], "vllm:request_success_total")
    hits = per_engine(pair["leader"], "vllm:prefix_cache_hits_total")
    assert served[rank] - after[rank] == 3, (rank, after, served)
    assert hits[rank] - hits0.get(rank, 0) > 3 * 300, (rank, hits0, hits)  # most of each prompt's tokens
    other = "1" if rank == "0" else "0"
    assert hits.get(other, 0) == hits0.get(other, 0), (hits0, hits)


def test_sigterm_to_the_node_ends_it_and_then_the_leader(pair):
    """Last for this pair: it ends it."""
    node, leader, frontend = pair["node"], pair["leader"], pair["frontend"]
    node.popen.send_signal(signal.SIGTERM)
    assert node.popen.wait(120) == 0, node.log_tail()
    assert leader.popen.wait(120) == 3, leader.log_tail()  # its rank 1 is gone: engine dead, unregistered
    wait_until(lambda: instances_of(frontend, MODEL) == 0, 15, "the leader gone from discovery", [frontend])


def test_sigterm_to_the_leader_ends_it_and_then_the_node(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("multi-node-b")
    env = base_env(str(root / "discovery"))
    state = None
    try:
        state = start_pair("b", root, env)
        leader, node = state["leader"], state["node"]
        leader.popen.send_signal(signal.SIGTERM)
        assert leader.popen.wait(120) == 0, leader.log_tail()
        assert node.popen.wait(120) in (0, 3), node.log_tail()  # its engine core saw the leader go
    finally:
        stop_all(state["procs"] if state else [])
