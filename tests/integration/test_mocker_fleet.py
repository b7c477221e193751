"""A fleet of 32 simulated workers in one mocker process behind the real frontend, driven
with the official openai client. No vLLM engine runs here: these fixtures are the module's own."""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_json,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.mocker.timing import TimingProfile, load_profile
from turbine.model.prepare import DEFAULT_MODEL

FLEET = 32
MODEL = DEFAULT_MODEL  # the fleet serves the embedded model's tokenizer under its name
SLOW = "slow-mocker"  # one worker in real time (speedup 1): requests last long enough to cancel
TARGET = "calibration-target"  # one worker with a known timing profile, for `turbine mocker calibrate`
TARGET_TIMING = TimingProfile(step_base_ms=20, prefill_ms_per_token=0.5, decode_ms_per_seq=2,
                              decode_ms_per_kv_token=0.01)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def mockers(tmp_path_factory):
    root = tmp_path_factory.mktemp("mocker-fleet")
    env = base_env(str(root / "discovery"))
    fleet = start_mocker("mocker-fleet", env, root, "--num-workers", str(FLEET), "--speedup-ratio", "0")
    slow = start_mocker("mocker-slow", env, root, "--served-model-name", SLOW, "--speedup-ratio", "1")
    profile = root / "target-profile.json"
    profile.write_bytes(msgspec.json.encode(TARGET_TIMING))
    target = start_mocker("mocker-target", env, root, "--served-model-name", TARGET, "--profile", str(profile))
    frontend = start_frontend("mocker-frontend", env, root)
    procs = [fleet, slow, target, frontend]
    try:
        wait_until(lambda: all(worker_ready(m) for m in (fleet, slow, target)), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == FLEET and instances_of(frontend, SLOW) == 1, 30,
                   "frontend sees every simulated worker", procs)
        yield {"env": env, "fleet": fleet, "slow": slow, "frontend": frontend}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def client(mockers) -> OpenAI:
    return OpenAI(base_url=f"{mockers['frontend'].url}/v1", api_key="unused", max_retries=0, timeout=60)


def per_worker(text: str, name: str) -> dict[str, float]:
    """worker_id -> value of one metric, summed over its other labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            worker = re.search(r'worker_id="([^"]+)"', line).group(1)
            values[worker] = values.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_every_simulated_worker_is_its_own_instance(mockers, client):
    fleet = mockers["fleet"]
    before = per_worker(http_text(f"{fleet.url}/metrics"), "turbine_worker_requests_total")
    for _ in range(FLEET):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    after = per_worker(http_text(f"{fleet.url}/metrics"), "turbine_worker_requests_total")
    # Round-robin over 32 instances: every simulated worker served exactly one request.
    assert len(after) == FLEET
    assert all(after[w] - before.get(w, 0.0) == 1 for w in after)
    text = http_text(f"{fleet.url}/metrics")
    assert len(per_worker(text, "turbine_worker_total_kv_blocks")) == FLEET
    assert httpx.get(f"{fleet.url}/health", timeout=30).json() == {"status": "healthy"}
    assert httpx.get(f"{fleet.url}/live").status_code == 200


def test_chat_completions_with_usage(client):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=7)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert resp.usage.completion_tokens == 7 and resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    # The simulated answer is a function of the prompt: the same question gets the same text.
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=7)
    assert again.choices[0].message.content == choice.message.content


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True,
                                          top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_chat_without_max_tokens_ends_with_eos(client):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION)
    assert resp.choices[0].finish_reason == "stop"
    assert 64 <= resp.usage.completion_tokens <= 192  # --natural-output-len 128, +-50%


def test_streamed_chat_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 9


def test_completions_streamed_and_not_with_n(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2,
                                     extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert resp.usage.completion_tokens == 12
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_prefix_cache_hits_are_reported_as_cached_tokens(client):
    prompt = list(range(1000, 1200))  # 200 token ids; the slow mocker has one worker
    first = client.completions.create(model=SLOW, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=SLOW, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Full 64-token blocks, and the last prompt token is always recomputed: 3 blocks.
    assert second.usage.prompt_tokens_details.cached_tokens == 192


def test_a_chat_answer_sent_back_is_found_in_the_prefix_cache(client):
    """The simulated answer's text encodes back to the tokens the worker generated (and cached
    while decoding), so the next turn reuses it, as with a real model."""
    messages = [{"role": "system", "content": "You answer questions about geography. " * 20}, *QUESTION]
    first = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=100,
                                           extra_body={"ignore_eos": True})
    prompt = first.usage.prompt_tokens
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=2)
    # Full 64-token blocks of the first prompt and the 99 answer tokens computed after it.
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt + 99) // 64 * 64 > prompt


def test_a_cancelled_stream_frees_the_workers_blocks(mockers, client):
    slow = mockers["slow"]

    def blocks_in_use() -> float:
        return metric(http_text(f"{slow.url}/metrics"), "turbine_mocker_kv_blocks_in_use")

    cancelled_before = metric(http_text(f"{slow.url}/metrics"), "turbine_worker_cancellations_total")
    stream = client.chat.completions.create(model=SLOW, messages=QUESTION, max_tokens=2000, stream=True,
                                            extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    assert blocks_in_use() > 0
    stream.close()
    wait_until(lambda: blocks_in_use() == 0, 10, "blocks freed", [slow])
    assert metric(http_text(f"{slow.url}/metrics"), "turbine_worker_cancellations_total") == cancelled_before + 1


@pytest.mark.parametrize("path", ["request-plane", "frontend"])
def test_calibrate_measures_a_workers_step_times(mockers, tmp_path, path):
    out = tmp_path / "fitted.json"
    cmd = [sys.executable, "-m", "turbine.cli", "mocker", "calibrate", "--model", TARGET, "--output", str(out),
           "--prompt-lens", "32,256,512", "--repeats", "2", "--batch-sizes", "1,8",
           "--decode-prompt-lens", "64,512", "--decode-tokens", "24", "--cached-prefix-lens", "256"]
    if path == "frontend":
        cmd += ["--url", mockers["frontend"].url]
    result = subprocess.run(cmd, env=mockers["env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    fitted = load_profile(out)
    assert ("through the frontend" in fitted.source) == (path == "frontend")
    # No timed assertions: the fit's accuracy is proven on exact data in the unit tests.
    # Here: the command measured a live worker (over the request plane, or through the
    # frontend's streaming API) and wrote a usable profile whose shape follows the target's
    # (a 512-token prefill costs ~8x a 32-token one).
    assert all(v >= 0 for v in msgspec.structs.asdict(fitted).values() if isinstance(v, (int, float)))
    assert fitted.step_ms(512, 512 * 256, 0, 0) > 2 * fitted.step_ms(32, 32 * 16, 0, 0)


def test_calibrate_names_a_bad_url(mockers, tmp_path):
    cmd = [sys.executable, "-m", "turbine.cli", "mocker", "calibrate", "--model", TARGET,
           "--output", str(tmp_path / "x.json"), "--url", "localhost:8000"]
    result = subprocess.run(cmd, env=mockers["env"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--url" in result.stderr


def test_an_idle_client_connection_outlives_the_clients_keep_alive(mockers):
    # httpx and the openai client reuse a connection idle for up to 5 s. At uvicorn's default (the
    # server closes it after 5 s idle) a request sent on it as the close lands fails before it reaches
    # the frontend: the chaos benchmark lost requests that way with no fault injected.
    conn = http.client.HTTPConnection("127.0.0.1", mockers["frontend"].port, timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        time.sleep(6.5)
        conn.request("GET", "/health")  # the same socket (http.client reconnects only after a close it saw)
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_startup_time_holds_registration_back(mockers, tmp_path):
    # --startup-time simulates an engine loading its model: the status server answers at once,
    # but the worker says "starting" and is not routable until that time has passed. A lower
    # bound only (a sleep never ends early); without the delay the gap is well under a second.
    startup_s, name = 4.0, "starting-mocker"
    late = start_mocker("mocker-starting", mockers["env"], tmp_path, "--served-model-name", name,
                        "--startup-time", str(startup_s))
    try:
        wait_until(lambda: http_json(f"{late.url}/live")[0] == 200, 60, "status server up", [late])
        live_at = time.monotonic()
        assert http_json(f"{late.url}/health") == (503, {"status": "starting"})
        assert instances_of(mockers["frontend"], name) == 0
        wait_until(lambda: instances_of(mockers["frontend"], name) == 1, 60, "the worker registered", [late])
        assert time.monotonic() - live_at >= startup_s - 2, "registered before its start-up time was over"
        assert worker_ready(late)
    finally:
        late.stop()


def test_sigterm_unregisters_every_worker_and_exits_cleanly(mockers):
    # Last in this module: it stops the fleet.
    fleet, frontend = mockers["fleet"], mockers["frontend"]
    fleet.popen.send_signal(signal.SIGTERM)
    assert fleet.popen.wait(30) == 0, fleet.log_tail()
    wait_until(lambda: instances_of(frontend, MODEL) == 0, 10, "fleet unregistered", [frontend])
