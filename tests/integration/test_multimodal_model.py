"""The test vision-language model (tests/multimodal_model.py) itself, so the fixture the multimodal tests stand on
can't rot: it builds deterministically (same seed, same bytes), and vLLM CPU serves it with pictures in a chat —
greedy answers repeat, another picture gives another answer, the same picture the same answer (in one batch and
alone). This tests the fixture, not a Turbine feature. One real engine, in a process of its own (run it under the
engine lock: flock /tmp/turbine-engine.lock)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from tests.multimodal_model import build_vlm

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, model_dir) -> str:
    return str(build_vlm(tmp_path_factory.mktemp("vlm") / "model", text_model_dir=model_dir))


@pytest.fixture(scope="module")
def answers(vlm_dir) -> dict[str, list[int]]:
    out = subprocess.run([sys.executable, "-m", "tests.integration.multimodal_reference", vlm_dir, str(MAX_TOKENS)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith('{"answers"'))  # vLLM logs there too
    return json.loads(line)["answers"]


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, vlm_dir, model_dir):
    from pathlib import Path

    again = build_vlm(tmp_path / "again", text_model_dir=model_dir)
    other = build_vlm(tmp_path / "other", text_model_dir=model_dir, seed=1)
    weights = Path(vlm_dir) / "model.safetensors"
    assert _digest(again / "model.safetensors") == _digest(weights)
    assert _digest(other / "model.safetensors") != _digest(weights)


def test_vllm_serves_it_deterministically(answers):
    assert all(tokens for tokens in answers.values()), answers
    assert answers["red#0"] == answers["red#3"] == answers["red-alone"]


def test_another_picture_another_answer(answers):
    assert answers["red#0"] != answers["blue#1"]
    assert answers["red#0"] != answers["green#2"]
    assert answers["blue#1"] != answers["green#2"]
