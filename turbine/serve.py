"""`turbine serve`: one frontend + one vLLM worker on this machine (or, with --disagg, one
prefill and one decode worker joined by NIXL), file discovery in a private directory,
Ctrl-C stops them all cleanly."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from turbine.flag_sources import (
    add_config_arg,
    config_key_flag,
    config_tokens,
    env_errors,
    env_name,
    load_config_file,
    split_config_arg,
    with_config_file,
)
from turbine.logging_setup import add_logging_args, logging_choices
from turbine.model.prepare import DEFAULT_MODEL, EMBEDDED_MODELS, resolve
from turbine.tracing import add_tracing_args
from turbine.worker.config import add_serving_args

if TYPE_CHECKING:
    from turbine.router.policy import RouterConfig

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 40


SERVE_DESCRIPTION = (
    "Serve a model with one frontend and one vLLM worker (--disagg: a prefill and a decode worker) on this machine. "
    "Frontend flags (turbine frontend --help) go to the frontend; flags that both the frontend and the worker "
    "have (--namespace, --migration-limit, the discovery and TLS flags) go to both; every other flag goes to the "
    "worker (turbine worker --help: Turbine's worker flags and every vLLM engine flag, e.g. --max-model-len 4096). "
    "Nothing given is set: each process keeps its TURBINE_* environment settings and defaults (the frontend "
    "binds 127.0.0.1:8000 unless told otherwise), except that the workers get --no-kv-events unless the frontend "
    "routes by KV events, a KV-events flag is given, or a discovery flag (another router could read them).")


def build_parser() -> argparse.ArgumentParser:
    """The flags `turbine serve` reads itself (the rest go to the frontend and the worker)."""
    p = argparse.ArgumentParser(prog="turbine serve", description=SERVE_DESCRIPTION, allow_abbrev=False,
                                usage="turbine serve [MODEL] [--config FILE] [serve, frontend and worker flags]")
    p.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                   help=f"embedded model name, local Hugging Face folder or hub id, as `vllm serve MODEL` takes it "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--model", default=None, help="the same as MODEL")
    add_config_arg(p)
    p.add_argument("--api-key", default=None,
                   help="the frontend's API key, given to it through its environment, out of `ps` "
                        "(TURBINE_API_KEY, which also works here)")
    p.add_argument("--cluster-key", default=None,
                   help="cluster key of the internal planes, given to the frontend and the worker(s) through "
                        "their environment (TURBINE_CLUSTER_KEY, which also works here)")
    p.add_argument("--cluster-key-file", default=None,
                   help="file holding the cluster key (TURBINE_CLUSTER_KEY_FILE, which also works here)")
    # Observability for every child: through their environment (TURBINE_LOG_LEVEL, TURBINE_LOG_FORMAT,
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), so that the frontend gets them too and vLLM's own parser
    # (whose --log-level takes upper case only) never sees ours.
    add_logging_args(p)
    add_tracing_args(p)
    p.add_argument("--disagg", action="store_true",
                   help="disaggregated serving: a prefill worker and a decode worker, the prompt's KV moved "
                        "between them by NIXL (--connector nixl unless you give --connector or "
                        "--kv-transfer-config)")
    return p


@dataclass
class ServePlan:
    """What `turbine serve` starts: command lines and environment additions of each process."""

    model: str
    served_name: str
    url: str  # where the frontend answers (loopback when it binds every interface)
    frontend_cmd: list[str]
    worker_cmds: list[list[str]]
    env: dict[str, str]  # added to every child's environment
    disagg: bool
    status_ports: list[int]  # the workers' status servers (/metrics, /health) that serve knows of


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for opt, a in parser._option_string_actions.items() if opt.startswith("--")}


def worker_turbine_flags() -> dict[str, argparse.Action]:
    """Turbine's own worker flags (without importing vLLM)."""
    p = argparse.ArgumentParser(add_help=False)
    add_serving_args(p)
    return _option_actions(p)


def split_tokens(tokens: list[str], owners: dict[str, argparse.Action]) -> tuple[list[str], list[str]]:
    """(the tokens of flags in `owners` with their values, every other token)."""
    mine, others, i = [], [], 0
    while i < len(tokens):
        name = tokens[i].split("=", 1)[0]
        action = owners.get(name)
        if action is None:
            others.append(tokens[i])
            i += 1
            continue
        take = 1 if action.nargs == 0 or "=" in tokens[i] else 2
        mine += tokens[i:i + take]
        i += take
    return mine, others


def plan(argv: list[str], workdir: str) -> ServePlan:
    """Read serve's own flags and split the rest (and the --config file's settings) between the
    frontend and the worker. A config file's share for each child is written to `workdir` and given
    to it as its own --config, so that each child applies flags > file > environment > defaults."""
    from turbine.frontend.args import build_parser as frontend_parser
    from turbine.frontend.args import frontend_config_from_args

    parser = build_parser()
    positional: list[str] = []
    if argv and not argv[0].startswith("-"):
        positional, argv = argv[:1], argv[1:]
    try:
        path, argv = split_config_arg(argv)
        settings = load_config_file(path) if path else {}
    except ValueError as exc:
        parser.error(str(exc))
    own = _option_actions(parser)
    fe_parser = frontend_parser(prog="turbine serve")
    frontend, worker = _option_actions(fe_parser), worker_turbine_flags()
    shared = {k: v for k, v in frontend.items() if k in worker}
    by_owner: dict[str, dict] = {"serve": {}, "frontend": {}, "worker": {}}
    for key, value in settings.items():
        opt = config_key_flag(key)
        if opt in own:
            by_owner["serve"][key] = value
        elif opt in frontend:
            by_owner["frontend"][key] = value
            if opt in shared:
                by_owner["worker"][key] = value
        else:
            by_owner["worker"][key] = value
    try:
        serve_from_file = config_tokens(parser, path, by_owner["serve"]) if path else []
    except ValueError as exc:
        parser.error(str(exc))
    serve_tokens, rest = split_tokens(argv, own)
    args = parser.parse_args(serve_from_file + positional + serve_tokens)
    if args.model_positional and args.model and args.model_positional != args.model:
        parser.error(f"the model is given twice: {args.model_positional!r} and --model {args.model!r}")
    model = args.model_positional or args.model or DEFAULT_MODEL
    frontend_tokens, worker_tokens = split_tokens(rest, frontend)
    shared_tokens, _ = split_tokens(frontend_tokens, shared)
    worker_tokens = shared_tokens + worker_tokens
    _check_omni(parser, worker_tokens, by_owner["worker"])

    def child_config(owner: str) -> list[str]:
        if not by_owner[owner]:
            return []
        file = os.path.join(workdir, f"{owner}-{os.path.basename(path)}")
        with open(file, "w") as f:
            yaml.safe_dump(by_owner[owner], f)
        return ["--config", file]

    frontend_argv = child_config("frontend") + frontend_tokens
    # The frontend's flags are checked here, before anything starts, and tell where it answers.
    with env_errors("turbine serve"):
        fe_cfg = frontend_config_from_args(fe_parser.parse_args(with_config_file(fe_parser, frontend_argv)),
                                           fe_parser)
    if fe_cfg.http_port == 0:
        parser.error("--http-port 0 (or TURBINE_HTTP_PORT=0): turbine serve must know where its frontend answers; "
                     "give a port between 1 and 65535")
    host = fe_cfg.http_host
    if host in ("0.0.0.0", "", "::"):
        host = "::1" if host == "::" else "127.0.0.1"
    url = f"http://[{host}]:{fe_cfg.http_port}" if ":" in host else f"http://{host}:{fe_cfg.http_port}"

    env = cluster_key_env(args, parser)
    if args.api_key:
        env["TURBINE_API_KEY"] = args.api_key
    env.update(observability_env(serve_from_file + serve_tokens, args))
    model_path = resolve(model)  # prepare the embedded model here, with visible progress
    # The same default the worker applies: the embedded model's name, else the model as given.
    from_file = next((str(v) for k, v in by_owner["worker"].items() if config_key_flag(k) == "--served-model-name"),
                     None)
    name = _served_name(worker_tokens) or from_file or (model if model in EMBEDDED_MODELS else model_path)
    worker_cmd = [sys.executable, "-m", "turbine.vllm", "--model", model, *child_config("worker"), *worker_tokens]
    if _kv_events_unread(fe_cfg.router, worker_tokens, by_owner["worker"]):
        worker_cmd.append("--no-kv-events")
    if args.disagg:
        if "kvbm" in _connector_words(worker_tokens, by_owner["worker"]):
            # Both workers get the same flags here, and a decode worker takes its prompt's KV over nixl only.
            parser.error("--connector kvbm with --disagg: turbine serve gives the prefill and the decode worker the "
                         "same flags, and a decode worker cannot take kvbm; start the prefill worker yourself with "
                         "`python -m turbine.vllm --disaggregation-mode prefill --connector kvbm nixl ...` "
                         "(docs/kv_tiers.md)")
        if not any(a.split("=")[0] in ("--connector", "--kv-transfer-config") for a in worker_tokens) and not \
                {"connector", "kv-transfer-config", "kv_transfer_config"} & set(by_owner["worker"]):
            worker_cmd += ["--connector", "nixl"]
        roles = [["--disaggregation-mode", "prefill"], ["--disaggregation-mode", "decode"]]
    else:
        roles = [[]]
    # Each worker's status server (/metrics with vLLM's own metrics, /health): after the HTTP port
    # (the next free one) unless the worker's flags, its config file or TURBINE_SYSTEM_PORT name one
    # (printed once ready, for Prometheus).
    given = _flag_value(worker_tokens, "--system-port") or next(
        (str(v) for k, v in by_owner["worker"].items() if config_key_flag(k) == "--system-port"), None) \
        or os.environ.get("TURBINE_SYSTEM_PORT") or None
    status_ports: list[int] = []
    worker_cmds = []
    for role in roles:
        cmd = list(worker_cmd)
        if given is None:
            status_ports.append(free_port_from(max(status_ports, default=fe_cfg.http_port) + 1))
            cmd += ["--system-port", str(status_ports[-1])]
        worker_cmds.append(cmd + role)
    if given is not None and not args.disagg and given.isdigit() and int(given) > 0:
        status_ports.append(int(given))
    return ServePlan(model=model, served_name=name, url=url,
                     frontend_cmd=[sys.executable, "-m", "turbine.frontend", *frontend_argv],
                     worker_cmds=worker_cmds, env=env, disagg=args.disagg, status_ports=status_ports)


def _wait_ready(url: str, model: str, procs: list[subprocess.Popen], prefill: bool = False) -> bool:
    """Until the frontend serves the model (and, disaggregated, has its prefill worker too)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                health = json.load(resp)
                if model in health.get("models", {}) and (not prefill or model in health.get("prefill_workers", {})):
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _stop(procs: list[subprocess.Popen], hurry: threading.Event | None = None) -> None:
    """SIGTERM to each child (a worker drains), then SIGKILL to what is left of its process group: a
    worker stopped while its engine was still starting left vLLM's EngineCore running, orphaned.
    Once `hurry` is set, nothing more is waited for."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline and not (hurry and hurry.is_set()):
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # each child leads its own group (preexec_fn=os.setpgrp)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left of it


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    workdir = tempfile.mkdtemp(prefix="turbine-serve-")
    p = plan(argv, workdir)
    env = dict(os.environ)
    # A private file discovery (a --discovery-* flag given to serve still reaches both processes).
    env["TURBINE_DISCOVERY_BACKEND"] = "file"
    env["TURBINE_DISCOVERY_DIR"] = os.path.join(workdir, "discovery")
    os.makedirs(env["TURBINE_DISCOVERY_DIR"])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default is sized for servers
    env.update(p.env)
    worker_envs = [dict(env, **cpus) for cpus in split_cpu_cores(env)] if p.disagg else [env]

    # Children ignore Ctrl-C from the terminal; we stop them in order with SIGTERM. A service
    # manager's SIGTERM does the same as Ctrl-C (by default it would end only this process and
    # leave the engines running).
    signal.signal(signal.SIGTERM, _interrupt)
    procs = [subprocess.Popen(p.frontend_cmd, env=env, preexec_fn=os.setpgrp),
             *(subprocess.Popen(cmd, env=wenv, preexec_fn=os.setpgrp) for cmd, wenv in zip(p.worker_cmds, worker_envs))]
    name, url = p.served_name, p.url
    try:
        what = "a prefill and a decode worker" if p.disagg else "worker"
        print(f"[turbine] starting {what} for {name!r} (an engine takes 30 s to a few minutes on a small CPU; the first start compiles)…", flush=True)
        if not _wait_ready(url, name, procs, prefill=p.disagg):
            print("[turbine] failed to start; see the logs above", file=sys.stderr)
            return 1
        print(f"[turbine] ready: OpenAI API at {url}/v1  (model {name!r}); Ctrl-C to stop", flush=True)
        workers_at = ", ".join(f"http://127.0.0.1:{port}/metrics" for port in p.status_ports) or "off"
        print(f"[turbine] metrics: frontend {url}/metrics; worker (Turbine's and vLLM's) {workers_at}", flush=True)
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        print("[turbine] a process exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[turbine] stopping…", flush=True)
        return 0
    finally:
        _stop(procs[::-1], _hurry_on_ctrl_c())  # workers first (they drain), then the frontend


def cluster_key_env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, str]:
    """The cluster key flags as environment for every child (the environment keeps the key out of `ps`)."""
    if args.cluster_key and args.cluster_key_file:
        parser.error("give the key once: --cluster-key or --cluster-key-file, not both")
    if args.cluster_key:
        return {"TURBINE_CLUSTER_KEY": args.cluster_key}
    if args.cluster_key_file:
        return {"TURBINE_CLUSTER_KEY_FILE": os.path.abspath(args.cluster_key_file)}
    return {}


def observability_env(serve_argv: list[str], args: argparse.Namespace) -> dict[str, str]:
    """The logging and tracing settings given to serve (its flags and its config file's, in `serve_argv`)
    as environment for every child. A bad TURBINE_LOG_* value stops serve here, named in one line;
    settings the user did not give are left to each child's own environment and defaults."""
    logging_choices(serve_argv, "turbine serve")
    env = {}
    if args.log_level:
        env["TURBINE_LOG_LEVEL"] = args.log_level
    if args.log_format:
        env["TURBINE_LOG_FORMAT"] = args.log_format
    if args.otlp_traces_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = args.otlp_traces_endpoint
    return env


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _hurry_on_ctrl_c() -> threading.Event:
    """While serve stops its children: a second Ctrl-C stops them at once (SIGKILL), as a user pressing it again
    means; a second SIGTERM (`timeout` signals its child, then its whole process group) is ignored, so the workers
    still drain. Either one, raised as an exception, used to cut the stop short, leaving the frontend up without
    serve, holding its port."""
    hurry = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: hurry.set())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return hurry


def _served_name(worker_args: list[str]) -> str | None:
    return _flag_value(worker_args, "--served-model-name")


def _connector_words(tokens: list[str], file_settings: dict) -> list[str]:
    """The connectors the worker flags (`--connector kvbm nixl`, `--connector=kvbm,nixl`) or its config file name."""
    words: list[str] = []
    for i, tok in enumerate(tokens):
        if tok == "--connector":
            for nxt in tokens[i + 1:]:
                if nxt.startswith("-"):
                    break
                words.append(nxt)
        elif tok.startswith("--connector="):
            words.append(tok.split("=", 1)[1])
    value = file_settings.get("connector")
    if value is not None:
        words += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return [w for word in words for w in word.replace(",", " ").split()]


def _check_omni(parser, worker_tokens: list[str], from_file: dict) -> None:
    """The omni worker's flags (given here or in the config file) refused before anything starts, as the worker
    would refuse them (turbine/vllm/omni_config.py): each needs the other, the file, vllm-omni on this build."""
    filed = {config_key_flag(k): v for k, v in from_file.items()}
    omni = "--omni" in worker_tokens or filed.get("--omni") is True
    stages = _flag_value(worker_tokens, "--stage-configs-path") or filed.get("--stage-configs-path")
    if omni or stages is not None:
        from turbine.vllm.omni_config import omni_flags_refusal

        if (refusal := omni_flags_refusal(omni, stages)) is not None:
            parser.error(refusal)


KV_EVENTS_FLAGS = ("--kv-events-port", "--kv-events-buffer", "--no-kv-events")
SHARED_DISCOVERY_FLAGS = ("--discovery-backend", "--discovery-dir", "--etcd-endpoints")


def _kv_events_unread(router: RouterConfig, worker_tokens: list[str], worker_settings: dict) -> bool:
    """Whether nothing reads the workers' KV events: serve's frontend routes by none (round-robin, its default, or
    random) and no other router can find the workers (serve's discovery is private unless a discovery flag says
    otherwise). Then the engines publish none and the workers relay none (--no-kv-events), unless the user set a
    KV-events flag (or its TURBINE_* variable) themselves."""
    named = {t.split("=")[0] for t in worker_tokens if t.startswith("--")} | {config_key_flag(k) for k in worker_settings}
    return not (router.follows_kv_events or named & {*KV_EVENTS_FLAGS, *SHARED_DISCOVERY_FLAGS}
                or any(os.environ.get(env_name(flag)) for flag in KV_EVENTS_FLAGS))


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def free_port_from(port: int) -> int:
    """`port` if nothing listens on it on loopback, else the next free one."""
    import socket

    for candidate in range(port, min(port + 100, 65536)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    raise SystemExit(f"turbine serve: no free port from {port} for the worker's status server (give --system-port)")


def split_cpu_cores(env: dict) -> list[dict]:
    """With the CPU engine, the prefill and the decode worker each get half of this machine's
    cores for their compute threads. Sharing all of them, each engine's threads wait on the
    other's at every step (and an engine that waits on a KV transfer polls without sleeping):
    on 2 cores the pair ran several times slower. A binding the user set is kept."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return [{}, {}]  # a GPU build: each engine has its own device
    cores = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" in env or len(cores) < 2:
        return [{}, {}]
    half = len(cores) // 2
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, part))} for part in (cores[:half], cores[half:])]
