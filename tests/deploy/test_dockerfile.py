"""The Dockerfile, read as Docker reads it (stages, instructions): images whose entrypoint is
`turbine` and whose default command Turbine's parser accepts, the engine installed from the
project's own `cpu` extra with PyTorch's CPU index, and a build context that holds what it copies."""

from __future__ import annotations

import json
import shlex

from tests.deploy.manifests import REPO, parse_turbine

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in _instructions():
        if word == "FROM":
            current = rest.split()[-1]  # FROM image AS name
            stages[current] = []
        elif current is not None:
            stages[current].append((word, rest))
    return stages


def _last(stage: list[tuple[str, str]], word: str) -> str:
    return [rest for w, rest in stage if w == word][-1]


def test_the_images_run_turbine_as_their_user():
    stages = _stages()
    assert list(stages)[-1] == "cpu"  # the default target: `docker build .`
    for name in ("core", "cpu"):
        assert json.loads(_last(stages[name], "ENTRYPOINT")) == ["turbine"], name
        assert _last(stages[name], "USER") == "turbine", name


def test_the_default_command_parses():
    cmd = json.loads(_last(_stages()["cpu"], "CMD"))
    parsed = parse_turbine(cmd, {"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert parsed.command == "serve" and parsed.config.http_host == "0.0.0.0"  # reachable through -p


def test_the_engine_comes_from_the_projects_cpu_extra_and_pytorchs_cpu_index():
    engine = _stages()["engine"]
    args = [shlex.split(rest) for w, rest in engine if w == "ARG"]
    assert ["TORCH_INDEX_URL=" + PYTORCH_CPU_INDEX] in args
    run = " ".join(rest for w, rest in engine if w == "RUN")
    assert 'pip install --extra-index-url "$TORCH_INDEX_URL" ".[cpu]"' in run  # the version pins are pyproject's


def test_the_build_context_holds_what_the_dockerfile_copies():
    """.dockerignore leaves out everything but what is re-included; every COPY source must be."""
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    included = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for word, rest in _instructions():
        if word == "COPY" and not rest.startswith("--from="):
            for source in shlex.split(rest)[:-1]:
                top = source.rstrip("/").split("/")[0]
                assert top in included, f"COPY {source}: excluded from the build context by .dockerignore"
                assert (REPO / source).exists(), source


def test_the_engine_free_image_carries_what_the_planner_deployment_runs():
    """deploy/kubernetes/planner/ runs `turbine planner` (Kubernetes connector) from turbine:core."""
    run = " ".join(rest for w, rest in _stages()["core"] if w == "RUN")
    assert 'pip install ".[planner,kubernetes]"' in run
