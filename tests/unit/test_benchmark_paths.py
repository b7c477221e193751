"""The benchmarks run from any checkout: no path of one machine is built in, and their tools are
found where `make bench-tools` / `make bench-peer` put them unless a flag or the environment says."""

from __future__ import annotations

import ast
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


def benchmark_sources():
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted((ROOT / "benchmarks").rglob("*.py"))]


def test_no_benchmark_edits_sys_path():
    """They run as modules of the `benchmarks` package (benchmarks/README.md): the root is on the path already."""
    offenders = [f"{p.relative_to(ROOT)}:{n.lineno}" for p, tree in benchmark_sources() for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and ast.unparse(n).startswith("sys.path.")]
    assert offenders == []


def test_every_import_between_benchmarks_names_a_module_and_what_it_defines():
    """A moved or renamed helper breaks here, without starting the benchmark."""
    broken = []
    for p, tree in benchmark_sources():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "benchmarks"):
                continue
            target = ROOT.joinpath(*n.module.split("."))
            if target.is_dir() and all((target / f"{a.name}.py").exists() for a in n.names):
                continue  # `from benchmarks.routing import kv_routing_fleet`
            source = target.with_suffix(".py")
            if not source.exists():
                broken.append(f"{p.relative_to(ROOT)}:{n.lineno}: no module {n.module}")
                continue
            defined = set()
            for top in ast.parse(source.read_text()).body:
                if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(top.name)
                elif isinstance(top, (ast.Assign, ast.AnnAssign)):
                    defined |= {t.id for t in (top.targets if isinstance(top, ast.Assign) else [top.target])
                                if isinstance(t, ast.Name)}
                elif isinstance(top, (ast.Import, ast.ImportFrom)):
                    defined |= {(a.asname or a.name).split(".")[0] for a in top.names}
            broken += [f"{p.relative_to(ROOT)}:{n.lineno}: {n.module} has no {a.name}"
                       for a in n.names if a.name not in defined]
    assert broken == []
