"""The benchmarks run from any checkout: no path of one machine is built in, and their tools are
found where `make bench-tools` / `make bench-peer` put them unless a flag or the environment says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.lib import paths

ROOT = Path(__file__).resolve().parents[2]


def test_no_benchmark_script_names_a_folder_of_one_machine():
    pattern = re.compile(r"/(work|root|home)/")
    offenders = [f"{p.relative_to(ROOT)}:{i + 1}: {line.strip()}"
                 for p in sorted((ROOT / "benchmarks").rglob("*")) if p.suffix in (".py", ".sh")
                 for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert offenders == []


def test_aiperf_comes_from_the_environment_else_the_bench_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("AIPERF", "/opt/aiperf")
    assert paths.default_aiperf() == "/opt/aiperf"
    monkeypatch.delenv("AIPERF")
    fake = tmp_path / "bin" / "aiperf"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setattr(paths, "BENCH_VENV", tmp_path)
    assert paths.default_aiperf() == str(fake)


def test_the_peer_comes_from_the_environment_else_the_peer_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMO_PYTHON", "/opt/dynamo/python")
    assert paths.default_dynamo_python() == "/opt/dynamo/python"
    monkeypatch.delenv("DYNAMO_PYTHON")
    monkeypatch.setattr(paths, "PEER_VENV", tmp_path)
    assert paths.default_dynamo_python() is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert paths.default_dynamo_python() == str(tmp_path / "bin" / "python")


@pytest.mark.parametrize("inside", [True, False])
def test_shared_files_are_looked_up_in_then_beside_the_checkout(inside, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    target = (repo if inside else tmp_path) / "shared" / "data" / "trace.jsonl"
    target.parent.mkdir(parents=True)
    target.write_text("{}\n")
    monkeypatch.setattr(paths, "REPO_ROOT", repo)
    assert paths.shared_path("data", "trace.jsonl") == target
