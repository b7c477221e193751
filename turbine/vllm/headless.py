"""A secondary node of a multi-node vLLM deployment (`python -m turbine.vllm --headless`): vLLM's own engine
processes, and nothing of Turbine's serving (no request plane, no registration, no KV-event relay).

The two shapes of vLLM's own `vllm serve --headless`:
- **Data-parallel ranks** (`--data-parallel-size N --data-parallel-size-local L --data-parallel-start-rank S`):
  the engine cores of ranks S..S+L-1, which join the leader's data-parallel coordinator at
  `--data-parallel-address`:`--data-parallel-rpc-port`. The leader (a worker started with the same size, its own
  `--data-parallel-size-local`, start rank 0) fronts every rank: its card counts them (`data_parallel_size`),
  routers pick among them, its stat logger reports their load, and their KV events reach its relay, which
  listens on `--data-parallel-address`:`--kv-events-port` (+ rank, as vLLM offsets it) and republishes them as
  its own ranks'. So both give the same `--kv-events-port`.
- **Tensor/pipeline parallelism across nodes** (`--nnodes N --node-rank R > 0`, with `--master-addr` and
  `--master-port`): this node's model-runner workers in the leader's torch.distributed group; the leader
  (`--node-rank 0`) runs the engine core and serves.

The node answers `/live`, and `/health` on `--system-port`: 503 until the leader's card is in discovery (this
node's ranks serve only in the leader's group), then 200 while every engine process it started is alive.
It registers nothing, but reads discovery (the same `--discovery-*` settings as the leader): the leader's card
names the group its nodes joined (`node_group`), and once that card has been seen and is gone (the leader
stopped or died: vLLM's engine processes would outlive it), the node stops. SIGTERM or SIGINT stops its engine
processes and exits 0, as does the leader's departure; an engine process that dies on its own stops the rest
and exits 3, as a worker whose engine died. The leader notices this node's ranks gone by pinging them
(turbine.vllm.worker) and stops too.
"""

from __future__ import annotations

import asyncio
import logging

from turbine.config import make_registry
from turbine.runtime.lifecycle import stop_on_signals
from turbine.runtime.status_server import Health, make_app, serve_status
from turbine.vllm.args import WorkerConfig
from turbine.vllm.engine_fork import engine_cores_forked
from turbine.worker.host import EXIT_ENGINE_DEAD

log = logging.getLogger("turbine.vllm")

POLL_S = 1.0
LEADER_GONE_POLLS = 3  # polls in a row without the leader's card: it has gone


def node_group(parallel_config, remote_ranks: bool) -> str | None:
    """The address a leader's other nodes join, which names the group in the leader's card (`node_group`):
    the data-parallel RPC when ranks run elsewhere, torch.distributed's master across nodes; None: one node."""
    if remote_ranks:
        return f"{parallel_config.data_parallel_master_ip}:{parallel_config.data_parallel_rpc_port}"
    if (getattr(parallel_config, "nnodes", 1) or 1) > 1:
        return f"{parallel_config.master_addr}:{parallel_config.master_port}"
    return None


class HeadlessNode:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.health = Health()
        self.stopping = asyncio.Event()
        self._procs: list = []
        self._group: str | None = None  # the leader's node_group (its card names it)
        self._manager = None   # CoreEngineProcManager: data-parallel ranks
        self._executor = None  # MultiprocExecutor: tensor/pipeline workers of node rank > 0

    async def run(self) -> int:
        stop_on_signals(self.stopping)
        status = None
        if self.cfg.system_port is not None:
            status = await serve_status(make_app(self.health, lambda: None), self.cfg.system_host,
                                        self.cfg.system_port)
        registry = make_registry(self.cfg.discovery)
        await registry.backend.start()
        try:
            # On the main thread: there vLLM's engine cores can be forked (--engine-core-start), which ties them to
            # this process; the event loop waits the second or two this takes.
            with engine_cores_forked(self.cfg.engine_args, self.cfg.engine_core_start):
                self._procs = self._start()
            log.info("headless node: %s; waiting for the leader's card (node group %s)", self._what(), self._group)
            seen, missing = False, 0
            while not self.stopping.is_set():
                if (dead := self.failure()) is not None:
                    log.error("%s; stopping this node's other engine processes", dead)
                    return EXIT_ENGINE_DEAD
                # vLLM's engine processes outlive a leader that stopped or died: its card is how we know.
                there = any(card.node_group == self._group for card in await registry.list_models())
                missing = 0 if there else missing + 1
                if there and not seen:  # healthy from now: this node's engine processes serve in the leader's group
                    log.info("the leader is serving (its card names node group %s)", self._group)
                    self.health.set_ready(self._canary, failure=self.failure)
                seen = seen or there
                if seen and missing >= LEADER_GONE_POLLS:
                    log.info("the leader has left discovery: stopping this node's engine processes")
                    return 0
                try:
                    await asyncio.wait_for(self.stopping.wait(), POLL_S)
                except TimeoutError:
                    pass
            log.info("stopping this node's engine processes")
            return 0
        finally:
            await registry.backend.close()
            self.health.set_not_ready()
            await asyncio.to_thread(self._shutdown)
            if status is not None:
                status.should_exit = True

    def _start(self) -> list:
        from vllm.config import KVEventsConfig
        from vllm.usage.usage_lib import UsageContext

        cfg, args = self.cfg, self.cfg.engine_args
        if (args.data_parallel_size or 1) > 1 and args.enable_prefix_caching and cfg.kv_events_port is not None:
            # This node's ranks publish to the leader's relay, which republishes them as the leader's ranks.
            args.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                   endpoint=f"tcp://{cfg.data_parallel_address}:{cfg.kv_events_port}")
        vllm_config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
        pc = vllm_config.parallel_config
        self._group = node_group(pc, remote_ranks=pc.node_rank_within_dp == 0)
        if pc.node_rank_within_dp > 0:
            from vllm.v1.executor.multiproc_executor import MultiprocExecutor

            self._executor = MultiprocExecutor(vllm_config, monitor_workers=False)
            return [handle.proc for handle in self._executor.workers]
        from vllm.utils.network_utils import get_tcp_uri
        from vllm.v1.engine.utils import CoreEngineProcManager
        from vllm.v1.executor import Executor

        self._manager = CoreEngineProcManager(
            local_engine_count=pc.data_parallel_size_local, start_index=pc.data_parallel_rank, local_start_index=0,
            vllm_config=vllm_config, local_client=False,
            handshake_address=get_tcp_uri(pc.data_parallel_master_ip, pc.data_parallel_rpc_port),
            executor_class=Executor.get_class(vllm_config), log_stats=not args.disable_log_stats)
        return list(self._manager.processes)

    def _what(self) -> str:
        args = self.cfg.engine_args
        if self._executor is not None:
            return (f"node rank {args.node_rank} of {args.nnodes}: {len(self._procs)} model-runner worker(s) in the "
                    f"leader's group at {args.master_addr}:{args.master_port}")
        first = args.data_parallel_start_rank
        return (f"data-parallel ranks {first}..{first + len(self._procs) - 1} of {args.data_parallel_size}, fronted by "
                f"the leader at {self.cfg.data_parallel_address}:{args.data_parallel_rpc_port}")

    async def _canary(self) -> str | None:
        return self.failure()

    def failure(self) -> str | None:
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self._procs if p.exitcode is not None]
        return f"engine process(es) exited: {', '.join(dead)}" if dead else None

    def _shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()
        if self._executor is not None:
            self._executor.shutdown()
