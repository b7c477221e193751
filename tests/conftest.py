"""Shared fixtures: a real etcd server, the NATS server's address, and Python child processes to kill;
the `engine` marker and the xdist groups that let `make test` run on two workers (docs/operations/tests.md)."""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.etcd_server import EtcdServer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def etcd_endpoint() -> Iterator[str]:
    """"127.0.0.1:PORT" of a real etcd: $TURBINE_TEST_ETCD, else a private one started here."""
    external = os.environ.get("TURBINE_TEST_ETCD")
    if external:
        yield external
        return
    with tempfile.TemporaryDirectory(prefix="turbine-etcd-") as work_dir:
        server = EtcdServer(Path(work_dir))
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(str(exc))
        try:
            yield server.endpoint
        finally:
            server.stop()


@pytest.fixture
def python_child():
    """`await python_child(code, *args)` runs `python -c code args` in the repo and returns
    (process, its first stdout line). Every child is killed at teardown."""
    procs: list[subprocess.Popen] = []

    async def start(code: str, *args: object, timeout: float = 15.0) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        procs.append(proc)
        async with asyncio.timeout(timeout):
            line = await asyncio.to_thread(proc.stdout.readline)
        return proc, line.strip()

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="session")
def nats_url() -> str:
    """The real NATS server the tests use ($TURBINE_TEST_NATS; scripts/run_tests.sh starts one if none listens)."""
    return os.environ.get("TURBINE_TEST_NATS", "nats://127.0.0.1:4222")


# Where the suite's time goes, per module (setup + call + teardown of its tests; a session-scoped
# fixture counts in the first module that uses it): printed at the end of every run.
# Under xdist, also per worker: the busiest one is the run's long pole.
_MODULE_SECONDS: collections.Counter[str] = collections.Counter()
_WORKER_SECONDS: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report) -> None:
    _MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration
    node = getattr(report, "node", None)  # the xdist worker that ran it
    if node is not None:
        _WORKER_SECONDS[node.gateway.id] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _MODULE_SECONDS:
        return
    terminalreporter.write_sep("=", f"slowest modules (of {len(_MODULE_SECONDS)}, {sum(_MODULE_SECONDS.values()):.0f} s)")
    for path, seconds in _MODULE_SECONDS.most_common(25):
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    for worker, seconds in sorted(_WORKER_SECONDS.items()):
        terminalreporter.write_line(f"{seconds:8.1f}s in the tests of xdist worker {worker}")


# Real vLLM engines: a module that starts one itself, or uses the session-wide `cluster` of
# tests/integration/conftest.py. Each takes a core or two for ~25 s to start, so under xdist
# (scripts/run_tests.sh: -n 2 --dist loadgroup) they all run on one worker, one module after the
# other, while the other worker takes the rest; the shared cluster is then started once. (Tried on the
# 2-core, 23 GiB host, 2026-11-29: each module that starts its own engines as a group of its own, so two
# engine modules ran at once. 1,115 s against 1,176 s, as the two cores were shared, and the kernel
# killed an engine for memory while two modules' engines started together. Not kept.)
_ENGINE_STARTS = ("start_worker(", '"turbine.vllm"')
# ... except these, one or two `uni` engines each, no NIXL and not on the shared cluster: a group of their own, which
# the other worker takes in its turn, so that the engine worker is not the whole run (2026-12-01, 2-core host: the
# engine worker's tests 943 s, the other's 808 s; embeddings and checkpoint 66 s). Two engine modules at once stay
# within memory here. Not the NIXL modules (disaggregation, disaggregated encode, KV tiers): run beside each other
# their engines took the same NIXL side-channel port ("Address already in use"); nor the rest on a third xdist
# worker: with the fork server (tests/integration/fork_server.py) the cores were 29 % idle over a two-worker run,
# but three workers gave 1,028 s against 1,066 s, an engine core died mid-test and 3.3 GiB of memory was left at
# the lowest (2026-12-01).
_ENGINE_ALONE = tuple(f"tests/integration/test_{name}.py" for name in (
    "embeddings", "checkpoint_vllm", "multimodal_model"))


@cache
def _starts_engines(path: Path) -> bool:
    text = path.read_text()
    return any(s in text for s in _ENGINE_STARTS)


def _uses_shared_cluster(item) -> bool:
    defs = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("cluster")
    return bool(defs) and defs[-1].func.__module__ == "tests.integration.conftest"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(config, items) -> None:
    by_module: dict[str, list] = collections.defaultdict(list)
    for item in items:
        by_module[item.nodeid.split("::")[0]].append(item)
    for module, its in by_module.items():
        # A whole module in one group: its own fixtures (a mocker fleet, say) start once, on one worker.
        on_cluster = any(_uses_shared_cluster(i) for i in its)
        if module in _ENGINE_ALONE and not on_cluster:
            group = "engine-alone"
        elif module.startswith("tests/integration/") and (_starts_engines(its[0].path) or on_cluster):
            group = "engine"
        elif any("nats_url" in i.fixturenames for i in its):
            group = "nats"  # one NATS server for all: its subjects and buckets, one module at a time
        else:
            group = module
        for item in its:
            if group.startswith("engine"):
                item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before the xdist worker sends the node ids to the controller
def pytest_collection_finish(session) -> None:
    """On an xdist worker under --dist loadgroup: the group as the node id's "@group" suffix, which
    is how the controller groups. pytest-xdist 3.8.0 does this itself, but on pytest 9.2's structured
    node ids its change is lost and every test is scheduled alone (pytest-dev/pytest-xdist#1386)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    from _pytest.nodes import coerce_node_id
    for item in session.items:
        group = item.get_closest_marker("xdist_group").args[0]
        if not item.nodeid.endswith(f"@{group}"):
            item._id = coerce_node_id(f"{item.nodeid}@{group}")
