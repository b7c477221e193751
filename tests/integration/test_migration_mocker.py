"""Request migration through the real frontend on simulated workers (one process each, so one
can be killed): a worker SIGKILLed or SIGTERMed mid-stream, its streams go on elsewhere and
the client sees one unbroken stream; with migration off, a clean SSE error event. Aggregated
(round-robin and KV-routed) and disaggregated. Every answer is one repeated token
(--reply-text), so the text of a migrated stream must equal an unbroken one exactly. Each case runs on
both request planes (TCP and NATS: `plane`)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    prefill_workers_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
REPLY = " the"  # one token: every output position holds it, on whichever worker
TOKENS = 150  # per stream: at the mocker's real-time speed, long enough to be cut mid-stream
PROMPT = "Tell me a story about a lighthouse keeper."
MOCKER = ["--reply-text", REPLY, "--block-size", "16"]


class Stream(threading.Thread):
    """One streamed completion read in the background through the official openai client."""

    def __init__(self, frontend, prompt: str = PROMPT, tokens: int = TOKENS):
        super().__init__(daemon=True)
        self.client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=120)
        self.prompt, self.tokens = prompt, tokens
        self.pieces: list[str] = []
        self.pieces_tokens = 0
        self.ids: set[str] = set()
        self.usage = self.error = self.finish = None
        self.start()

    def run(self):
        try:
            stream = self.client.completions.create(
                model=MODEL, prompt=self.prompt, max_tokens=self.tokens, stream=True, logprobs=0,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                self.ids.add(chunk.id)
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    self.pieces.append(choice.text)
                    self.finish = choice.finish_reason or self.finish
                    self.pieces_tokens += len(choice.logprobs.tokens or [])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def assert_unbroken(self, prompt_tokens: int):
        self.join(120)
        assert not self.is_alive() and self.error is None, self.error
        assert self.text == REPLY * self.tokens  # nothing duplicated, nothing missing
        assert self.pieces_tokens == self.tokens and self.finish == "length"
        assert (self.usage.prompt_tokens, self.usage.completion_tokens) == (prompt_tokens, self.tokens)
        assert len(self.ids) == 1  # one response id throughout


def raw_stream(frontend, result: dict):
    """A streamed completion read as raw SSE lines (to see an error event and [DONE])."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{frontend.url}/v1/completions", json=body, timeout=120) as r:
        result["status"] = r.status_code
        result["events"] = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]


def inflight(worker) -> float:
    return metric(http_text(f"{worker.url}/metrics"), "turbine_worker_inflight_requests")


def blocks_in_use(worker) -> float:
    return metric(http_text(f"{worker.url}/metrics"), "turbine_mocker_kv_blocks_in_use")


def migrations(frontend, reason: str) -> float:
    text = http_text(f"{frontend.url}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("turbine_frontend_migrations_total{") and f'reason="{reason}"' in line)


def streaming(streams: list[Stream], procs) -> None:
    wait_until(lambda: all(len(s.pieces) >= 3 for s in streams), 60, "every stream under way", procs)


def plane_env(env: dict, plane: str, nats_url: str) -> dict:
    """Every process of the deployment on `plane` (through the environment, as an operator might)."""
    return {**env, "TURBINE_REQUEST_PLANE": plane, "TURBINE_NATS_SERVER": nats_url}


@pytest.fixture(scope="module", params=["tcp", "nats"])
def plane(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, plane, nats_url):
    """Two workers whose cards allow 2 migrations; frontends: `card` (no flag: the cards'
    limit), `off` (--migration-limit 0 overrides the cards), `kv` (KV-routed, limit 2)."""
    root = tmp_path_factory.mktemp(f"migration-mocker-{plane}")
    env = plane_env(base_env(str(root / "discovery")), plane, nats_url)
    workers = [start_mocker(f"worker{i}", env, root, *MOCKER, "--migration-limit", "2") for i in (1, 2)]
    frontends = {"card": start_frontend("fe-card", env, root),
                 "off": start_frontend("fe-off", env, root, "--migration-limit", "0"),
                 "kv": start_frontend("fe-kv", env, root, "--router-mode", "kv", "--migration-limit", "2")}
    procs = [*workers, *frontends.values()]
    try:
        wait_until(lambda: all(worker_ready(w) for w in workers), 60, "mockers ready", procs)
        wait_until(lambda: all(instances_of(f, MODEL) == 2 for f in frontends.values()), 30,
                   "every frontend sees both workers", procs)
        reference = OpenAI(base_url=f"{frontends['card'].url}/v1", api_key="x").completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2)
        yield {"env": env, "root": root, "workers": workers, **frontends, "procs": procs,
               "prompt_tokens": reference.usage.prompt_tokens}
    finally:
        stop_all(procs)


def test_sigkilled_worker_streams_complete_elsewhere_or_fail_cleanly(fleet):
    """Round-robin and KV-routed streams on the killed worker go on on the other one; with
    migration off the client gets an SSE error event, then [DONE]; the survivor frees every block."""
    workers, procs = fleet["workers"], fleet["procs"]
    kv = Stream(fleet["kv"])
    wait_until(lambda: len(kv.pieces) >= 1, 30, "the kv-routed stream under way", procs)
    victim, survivor = sorted(workers, key=inflight, reverse=True)  # the worker the kv stream is on
    on_card = [Stream(fleet["card"]) for _ in range(4)]  # round-robin: two on each worker
    off = [{}, {}]
    off_threads = [threading.Thread(target=raw_stream, args=(fleet["off"], r), daemon=True) for r in off]
    for t in off_threads:
        t.start()
    streaming([kv, *on_card], procs)
    wait_until(lambda: inflight(victim) == 4 and inflight(survivor) == 3, 30, "all streams running", procs)
    victim.stop(signal.SIGKILL)

    for s in (kv, *on_card):
        s.assert_unbroken(fleet["prompt_tokens"])
    for t in off_threads:
        t.join(120)
        assert not t.is_alive()
    # Migration off: the stream on the killed worker ends with an error event and [DONE]; no hang.
    failed = [r for r in off if any('"error"' in e for e in r["events"])]
    assert len(failed) == 1 and all(r["status"] == 200 and r["events"][-1] == "[DONE]" for r in off), off
    error = json.loads(next(e for e in failed[0]["events"] if '"error"' in e))["error"]
    assert "failed mid-stream" in error["message"]
    assert migrations(fleet["card"], "disconnected") == 2 and migrations(fleet["kv"], "disconnected") == 1
    assert migrations(fleet["off"], "disconnected") == 0
    wait_until(lambda: blocks_in_use(survivor) == 0, 10, "the survivor's blocks freed", [survivor])


def test_sigterm_after_the_grace_period_migrates_what_still_runs(fleet):
    """A worker SIGTERMed with a 1 s grace period ends its running streams with shutting_down;
    the frontend continues them on the other worker."""
    survivor = next(w for w in fleet["workers"] if w.alive())
    leaving = start_mocker("worker-leaving", fleet["env"], fleet["root"], *MOCKER, "--migration-limit", "2",
                           "--graceful-shutdown-timeout", "1", "--speedup-ratio", "0.25")
    try:
        wait_until(lambda: worker_ready(leaving), 60, "third mocker ready", [leaving])
        wait_until(lambda: instances_of(fleet["card"], MODEL) == 2, 30, "the frontend sees the two live workers",
                   [leaving])
        streams = [Stream(fleet["card"]) for _ in range(4)]
        streaming(streams, [leaving])
        wait_until(lambda: inflight(leaving) == 2, 30, "two streams on the leaving worker", [leaving])
        leaving.popen.send_signal(signal.SIGTERM)
        for s in streams:
            s.assert_unbroken(fleet["prompt_tokens"])
        assert leaving.popen.wait(30) == 0
        assert migrations(fleet["card"], "shutting_down") == 2
        wait_until(lambda: blocks_in_use(survivor) == 0, 10, "the survivor's blocks freed", [survivor])
    finally:
        leaving.stop(signal.SIGKILL)


def test_disaggregated_stream_is_prefilled_again_after_its_decode_worker_dies(tmp_path, plane, nats_url):
    """The continuation of a disaggregated request goes through a prefill worker again (its
    prompt, with the tokens so far, is long) and decodes on the other decode worker."""
    env = plane_env(base_env(str(tmp_path / "discovery")), plane, nats_url)
    prefill = start_mocker("prefill", env, tmp_path, "--is-prefill-worker", "--block-size", "16")
    decode = [start_mocker(f"decode{i}", env, tmp_path, "--is-decode-worker", *MOCKER) for i in (1, 2)]
    frontend = start_frontend("fe-disagg", env, tmp_path, "--migration-limit", "1", "--max-local-prefill-length", "0")
    procs = [prefill, *decode, frontend]
    try:
        wait_until(lambda: all(worker_ready(w) for w in (prefill, *decode)), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2
                   and prefill_workers_of(frontend, MODEL) == 1,
                   30, "the frontend sees the prefill and both decode workers", procs)
        prompt_tokens = OpenAI(base_url=f"{frontend.url}/v1", api_key="x").completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
        stream = Stream(frontend)
        streaming([stream], procs)
        victim = max(decode, key=inflight)
        victim.stop(signal.SIGKILL)
        stream.assert_unbroken(prompt_tokens)
        text = http_text(f"{frontend.url}/metrics")
        remote = [line for line in text.splitlines()
                  if line.startswith("turbine_frontend_prefills_total") and 'where="remote"' in line]
        assert float(remote[0].rsplit(" ", 1)[1]) == 3  # the reference, the stream, its continuation
        assert migrations(frontend, "disconnected") == 1
        survivor = next(d for d in decode if d is not victim)
        wait_until(lambda: blocks_in_use(survivor) == 0 and blocks_in_use(prefill) == 0, 10,
                   "the survivor's and the prefill worker's blocks freed", procs[:1])
    finally:
        stop_all(procs)
