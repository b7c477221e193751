"""Checkpoint mode (TURBINE_SNAPSHOT_CONTROL_DIR) driven through its marker files against real
mocker processes. The vLLM worker with a real CRIU dump and restore: test_checkpoint_vllm.py; restore
against cold start: benchmarks/lifecycle/checkpoint_restore.py."""

from __future__ import annotations

import json
import socket

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    instances_of,
    start_frontend,
    start_mocker,
    wait_until,
    worker_ready,
)
from tests.integration.test_sleep_wake import registered
from turbine.model.prepare import DEFAULT_MODEL
from turbine.worker.snapshot import READY_FOR_CHECKPOINT, RESTORE_COMPLETE, RESTORE_CONTEXT, SNAPSHOT_COMPLETE

MODEL = DEFAULT_MODEL


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def setup(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    discovery = str(tmp_path / "discovery")
    env = base_env(discovery)
    env["TURBINE_SNAPSHOT_CONTROL_DIR"] = str(control)
    return {"root": tmp_path, "control": control, "discovery": discovery, "env": env}


def checkpoint_ready(s, name: str):
    worker = start_mocker(name, s["env"], s["root"], "--speedup-ratio", "0")
    wait_until(lambda: (s["control"] / READY_FOR_CHECKPOINT).exists(), 60, "ready-for-checkpoint", [worker])
    # Quiesced before any socket: no status server, nothing in discovery.
    assert not listening(worker.port)
    assert registered(s["discovery"]) == {}
    return worker


def test_snapshot_complete_exits_zero_without_registering(setup):
    worker = checkpoint_ready(setup, "checkpointed")
    try:
        (setup["control"] / SNAPSHOT_COMPLETE).touch()
        assert worker.popen.wait(30) == 0, worker.log_tail()
        assert registered(setup["discovery"]) == {}
        assert list(setup["control"].iterdir()) == []  # markers answered and removed
    finally:
        worker.stop()


def test_restore_complete_wakes_takes_its_identity_registers_and_serves(setup):
    worker = checkpoint_ready(setup, "restored")
    frontend = start_frontend("frontend", base_env(setup["discovery"]), setup["root"])
    try:
        # The restorer says who the copy is (a restored process keeps its checkpoint-time environment).
        (setup["control"] / RESTORE_CONTEXT).write_text(json.dumps(
            {"version": 1, "env": {"TURBINE_COMPONENT": "restored", "TURBINE_INSTANCE_ID": "restored-1"}}))
        (setup["control"] / RESTORE_COMPLETE).touch()
        wait_until(lambda: worker_ready(worker), 30, "restored worker healthy", [worker])
        assert list(registered(setup["discovery"])) == ["restored-1"]
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "frontend sees the restored worker",
                   [worker, frontend])
        client = OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=30)
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert out.usage.completion_tokens == 4
        assert not (setup["control"] / READY_FOR_CHECKPOINT).exists()
        assert not (setup["control"] / RESTORE_COMPLETE).exists()
        assert worker.stop() == 0
        assert registered(setup["discovery"]) == {}
    finally:
        frontend.stop()
        worker.stop()


def test_a_control_dir_that_does_not_exist_is_a_config_error(setup):
    setup["env"]["TURBINE_SNAPSHOT_CONTROL_DIR"] = str(setup["root"] / "missing")
    worker = start_mocker("bad-dir", setup["env"], setup["root"])
    assert worker.popen.wait(30) == 2
    assert "TURBINE_SNAPSHOT_CONTROL_DIR" in worker.log_tail()
