"""Checkpoint / restore of the real vLLM CPU worker with CRIU (issue #34 §1), driven by the
checkpoint markers (turbine/worker/snapshot.py), routed by a KV-routing frontend and asked with
the official openai client. Run it under the engine lock (flock /tmp/turbine-engine.lock).

CRIU >= 4.1 is needed on this kernel: tests/integration/criu.py builds it once (scripts/build_criu.sh);
the test skips only where `criu check` says the kernel forbids checkpointing.

KV events after a restore: the image holds an EMPTY cache (the worker quiesces before the dump:
scheduler paused and drained, prefix and encoder caches reset), and the restored worker registers as a
new instance, so routers have nothing of it to forget. Tested: the router indexes no block of the
restored worker until it serves, a prompt is not a cache hit on its first ask, and the blocks it then
stores reach the router through the re-bound KV-event relay."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from openai import OpenAI

from tests.integration import criu
from tests.integration.procs import ENGINE_FLAGS, Proc, base_env, instances_of, start_frontend, wait_until, worker_ready
from tests.integration.test_checkpoint_restore import listening
from tests.integration.test_kv_routing_vllm import PREFIX, indexed_blocks
from tests.integration.test_sleep_wake import registered
from turbine.model.prepare import DEFAULT_MODEL
from turbine.runtime.ports import free_port
from turbine.worker.snapshot import READY_FOR_CHECKPOINT, RESTORE_COMPLETE, RESTORE_CONTEXT

MODEL = DEFAULT_MODEL
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
BLOCK = 128  # vLLM's CPU block size


@pytest.fixture(scope="module")
def criu_bin():
    binary = criu.build()
    if (problem := criu.check(binary)) is not None:
        pytest.skip(f"this kernel does not let CRIU checkpoint processes (`criu check`):\n{problem}")
    return binary


def start_worker_session(name: str, env: dict, root: Path) -> Proc:
    """A vLLM worker in a session of its own with stdin from /dev/null: a tree CRIU can dump and restore
    without --shell-job (and no inherited file descriptors: Popen closes them)."""
    port = free_port()
    log_path = root / f"{name}.log"
    popen = subprocess.Popen([sys.executable, "-m", "turbine.vllm", "--system-port", str(port), *ENGINE_FLAGS],
                             env=env, stdin=subprocess.DEVNULL, stdout=open(log_path, "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, popen, log_path, port)


def greedy(client: OpenAI) -> list[str]:
    return [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in PROMPTS]


def cached_tokens(client: OpenAI, prompt: str) -> int:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def end(procs: list[psutil.Process], sig=signal.SIGTERM, timeout: float = 60) -> None:
    for p in procs[:1]:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)


def test_a_restored_vllm_worker_serves_the_same_greedy_answers_under_its_new_identity(tmp_path, criu_bin):
    control = tmp_path / "control"
    control.mkdir()
    discovery = str(tmp_path / "discovery")
    # Leases of 10 s, not the suite's 3 s: nothing here waits for one to lapse, and beside other engines on two cores
    # a worker's first request once held its heartbeat past 3 s (its lease lapsed between two requests: a 404).
    env = base_env(discovery, ttl=10.0)
    held = start_worker_session("checkpointed", dict(env, TURBINE_SNAPSHOT_CONTROL_DIR=str(control)), tmp_path)
    reference = start_worker_session("reference", env, tmp_path)  # the same engine, never checkpointed
    frontend = start_frontend("frontend", env, tmp_path, "--router-mode", "kv")
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)
    shm_before = set(os.listdir("/dev/shm"))
    restored: list[psutil.Process] = []
    try:
        # The answers to compare with: the reference worker's.
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 300, "the reference worker routed",
                   [reference, frontend, held])
        before = greedy(client)
        assert reference.stop() == 0
        wait_until(lambda: instances_of(frontend, MODEL) == 0, 30, "the reference worker gone", [frontend])

        # Checkpoint mode: engine built and quiesced, no socket of Turbine's open, nothing registered.
        wait_until(lambda: (control / READY_FOR_CHECKPOINT).exists(), 300, "ready-for-checkpoint", [held])
        assert not listening(held.port)
        assert registered(discovery) == {}
        images = tmp_path / "images"
        dumped = criu.dump(criu_bin, held.popen.pid, images)
        assert dumped.returncode == 0, criu.log_tail(images / "dump.log")
        held.popen.wait(30)  # the dump ends it; reaped so that the restore can take its pid back
        criu.wait_gone([held.popen.pid])
        (control / READY_FOR_CHECKPOINT).unlink()  # the image wrote it already

        restored = tree(criu.restore(criu_bin, images))
        (control / RESTORE_CONTEXT).write_text(json.dumps({"version": 1, "env": {"TURBINE_INSTANCE_ID": "restored-1"}}))
        (control / RESTORE_COMPLETE).touch()
        wait_until(lambda: worker_ready(held), 120, "the restored worker healthy (its canary passed)", [frontend])
        assert list(registered(discovery)) == ["restored-1"]
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "the frontend routes to the restored worker",
                   [frontend])
        assert greedy(client) == before

        # Its cache was empty in the image: the router holds none of its blocks (the greedy prompts fill
        # no whole block), a long prompt is no cache hit, and its blocks reach the router once stored.
        assert indexed_blocks(frontend).get("restored-1", 0) == 0
        assert cached_tokens(client, PREFIX + "First?") == 0
        wait_until(lambda: indexed_blocks(frontend).get("restored-1", 0) >= 4, 30,
                   "the restored worker's KV events indexed", [frontend])
        assert cached_tokens(client, PREFIX + "Second?") >= 4 * BLOCK

        end(restored)  # SIGTERM: unregisters, drains and exits
        assert registered(discovery) == {}
    finally:
        frontend.stop()
        reference.stop()
        held.stop()
        end(restored, timeout=30)
        shutil.rmtree(tmp_path / "images", ignore_errors=True)  # 3.5 GB: not kept with the test's logs
        for name in set(os.listdir("/dev/shm")) - shm_before:  # the dump's link-remap files
            if name.startswith("link_remap."):
                os.unlink(f"/dev/shm/{name}")
