"""Multi-node flags (issue #30 §1): a leader fronts data-parallel ranks from 0; the ranks and tensor/pipeline
workers of other nodes run with --headless; settings that cannot work together are refused by name."""

from __future__ import annotations

import pytest

from turbine.vllm.args import parse_worker_args

DP = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
      "--data-parallel-rpc-port", "29551"]
SECONDARY = [*DP, "--data-parallel-start-rank", "1", "--headless", "--kv-events-port", "29600"]


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_a_leader_and_a_secondary_parse():
    leader = parse_worker_args([*DP, "--kv-events-port", "29600"])
    assert not leader.headless and leader.remote_ranks and leader.data_parallel_size == 2
    assert leader.data_parallel_address == "127.0.0.1"
    node = parse_worker_args([*SECONDARY, "--system-port", "0"])
    assert node.headless and node.kv_events_port == 29600 and node.engine_args.data_parallel_start_rank == 1
    tp_node = parse_worker_args(["--headless", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2",
                                 "--master-addr", "127.0.0.1", "--master-port", "29700"])
    assert tp_node.headless
    assert not parse_worker_args([]).remote_ranks
    # Without KV events neither needs the relay's port.
    assert not parse_worker_args([*DP, "--no-kv-events"]).kv_events
    assert not parse_worker_args([*SECONDARY[:-2], "--no-kv-events", "--system-port", "0"]).kv_events


@pytest.mark.parametrize("argv, words", [
    # What a headless node would accept and then ignore: everything Turbine's serving reads.
    ([*SECONDARY, "--namespace", "prod"], "--namespace: a --headless node serves and registers nothing"),
    ([*SECONDARY, "--disaggregation-mode", "prefill"], "--disaggregation-mode: a --headless node"),
    ([*SECONDARY, "--connector", "kvbm"], "--connector: a --headless node"),
    ([*SECONDARY, "--migration-limit", "2"], "--migration-limit: a --headless node"),
    ([*SECONDARY, "--enable-multimodal"], "--enable-multimodal: a --headless node"),
    # A headless node that is no other node's part.
    (["--headless"], "--headless runs the engine processes of another node than the leader"),
    ([*DP, "--headless"], "--headless runs the engine processes"),
    # Ranks and nodes that do not exist.
    ([*DP, "--data-parallel-start-rank", "2", "--headless"], "--data-parallel-start-rank 2: the ranks are 0..1"),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "1",
      "--headless"], "--data-parallel-size-local 2 from rank 1: ranks up to 2, beyond --data-parallel-size 2"),
    (["--nnodes", "2", "--node-rank", "2", "--headless"], "--node-rank 2: the nodes are 0..1"),
    # A leader's mistakes.
    ([*DP, "--data-parallel-start-rank", "1"], "a worker fronts the ranks from 0"),
    (["--nnodes", "2", "--node-rank", "1"], "--node-rank 1: that node runs no engine front of its own"),
    (DP, "--kv-events-port: ranks of this worker run on other nodes"),
    ([*SECONDARY[:-2]], "--kv-events-port: this node's ranks publish their KV events to the leader's relay"),
    ([*DP, "--kv-events-port", "29600", "--data-parallel-hybrid-lb"], "--data-parallel-hybrid-lb is not supported"),
    ([*DP, "--kv-events-port", "29600", "--data-parallel-external-lb"], "--data-parallel-external-lb is not supported"),
])
def test_settings_that_cannot_work_are_refused_by_name(argv, words, capsys):
    assert words in refused(argv, capsys)


def test_without_prefix_caching_no_event_port_is_needed():
    assert parse_worker_args([*DP, "--no-enable-prefix-caching"]).remote_ranks
    assert parse_worker_args([*SECONDARY[:-2], "--no-enable-prefix-caching"]).headless
