"""Outages of the parts Turbine depends on, each under traffic from the official openai client,
with real servers and real processes (simulated workers: the outages are the point, not the
engine): etcd stopped for 30 s, the NATS server restarted, a frontend restarted."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import openai
from openai import OpenAI

from tests.etcd_server import EtcdServer
from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    wait_until,
    worker_ready,
)
from tests.nats_server import NatsServer
from tests.tcp_proxy import TcpProxy
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
ETCD_OUTAGE_S = 30
TTL_S = 3  # discovery TTL (file backend): a dead worker's records go soon
ETCD_TTL_S = 5  # etcd leases: a cut-off worker's lapses soon, a live one's keep-alive has slack on a busy machine
BLOCK = 16
SYSTEM = "You are a careful assistant who answers briefly and precisely. " * 24  # ~16 blocks


class Traffic:
    """`concurrency` clients sending requests through a frontend in a loop until stopped; every
    outcome kept as (started, ended, exception or None)."""

    def __init__(self, url: str, concurrency: int = 3, max_tokens: int = 8, stream: bool = False,
                 prompt=lambda i: f"Request {i}: say something short."):
        self.client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        self.concurrency, self.max_tokens, self.stream, self.prompt = concurrency, max_tokens, stream, prompt
        self.outcomes: list[tuple[float, float, BaseException | None]] = []
        self.in_flight = 0
        self._go = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(concurrency)]

    def start(self) -> Traffic:
        self._go.set()
        for t in self._threads:
            t.start()
        return self

    def pause(self) -> None:
        """No new request from now on (those in flight go on)."""
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for t in self._threads:
            t.join(180)

    @property
    def ok(self) -> int:
        return sum(1 for *_, exc in self.outcomes if exc is None)

    @property
    def failures(self) -> list[tuple[float, float, BaseException]]:
        return [o for o in self.outcomes if o[2] is not None]

    def _loop(self, n: int) -> None:
        i = 0
        while True:
            self._go.wait()
            if self._stop.is_set():
                return
            i += 1
            with self._lock:
                self.in_flight += 1
            started, exc = time.monotonic(), None
            try:
                self._one(f"{n}.{i}")
            except Exception as e:  # counted, never raised: the test looks at them all
                exc = e
            with self._lock:
                self.in_flight -= 1
                self.outcomes.append((started, time.monotonic(), exc))

    def _one(self, tag: str) -> None:
        messages = [{"role": "user", "content": self.prompt(tag)}]
        if self.stream:
            stream = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=self.max_tokens,
                                                         stream=True, extra_body={"ignore_eos": True})
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            r = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=self.max_tokens)
            text = r.choices[0].message.content
        assert text, "an empty answer"


def summary(traffic: Traffic) -> str:
    return f"{traffic.ok} ok, failures: " + "; ".join(f"{type(e).__name__}: {e}" for *_, e in traffic.failures[:5])


def blocks_in_use(worker) -> float:
    return metric(http_text(f"{worker.url}/metrics"), "turbine_mocker_kv_blocks_in_use")


def stop_all(procs) -> None:
    for p in procs:
        if p.alive():
            os.kill(p.popen.pid, signal.SIGCONT)  # a test that failed while it was stopped
        p.stop()


# --------------------------------------------------------------------------------------- etcd


def test_etcd_stopped_30s_under_traffic_fails_nothing_and_a_lapsed_worker_comes_back(tmp_path):
    etcd = EtcdServer(tmp_path)
    etcd.start()
    env = base_env(str(tmp_path / "unused"), ttl=ETCD_TTL_S)
    env.update(TURBINE_DISCOVERY_BACKEND="etcd", TURBINE_ETCD_ENDPOINTS=etcd.endpoint)
    # Worker b reaches etcd through a link the test cuts for longer than the outage: its lease
    # lapses while it is alive and serving (what a CPU-starved or partitioned worker lives through).
    link_b = TcpProxy(("127.0.0.1", etcd.client_port))
    a = start_mocker("etcd-worker-a", env, tmp_path)
    b = start_mocker("etcd-worker-b", {**env, "TURBINE_ETCD_ENDPOINTS": link_b.endpoint}, tmp_path)
    # No request migration: an etcd outage must not fail any request in the first place.
    frontend = start_frontend("etcd-frontend", env, tmp_path, "--migration-limit", "0")
    procs = [a, b, frontend]
    traffic = None
    try:
        wait_until(lambda: worker_ready(a) and worker_ready(b), 60, "workers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "frontend sees both", procs)
        traffic = Traffic(frontend.url).start()
        wait_until(lambda: traffic.ok >= 10, 30, "traffic flowing", procs)

        etcd.stop(kill=True)
        link_b.cut()
        served_before = traffic.ok
        time.sleep(ETCD_OUTAGE_S)
        # The frontend kept its workers: requests went on being served without etcd.
        served_during = traffic.ok - served_before
        assert served_during > 0, summary(traffic)
        assert instances_of(frontend, MODEL) == 2
        etcd.start()
        # The frontend watches again: it sees b's records expire while a's lease is kept alive...
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 60, "b's lease lapsed", procs)
        link_b.restore()
        # ...and b re-grants a lease and re-publishes its records by itself.
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "b registered again", procs)
        assert "expired while this process was alive; re-registering" in b.log_path.read_text()
        # a reconnected in time to keep its lease: the outage did not drop every worker at once.
        assert "etcd reachable again" in a.log_path.read_text()
        assert "expired while this process was alive" not in a.log_path.read_text()
        served_after = traffic.ok
        wait_until(lambda: traffic.ok >= served_after + 10, 30, "traffic after the outage", procs)
        traffic.stop()
        print(f"etcd outage: {served_during} requests served during the {ETCD_OUTAGE_S} s outage, "
              f"{traffic.ok} in all, {len(traffic.failures)} failed")
        assert traffic.failures == [], summary(traffic)
        wait_until(lambda: blocks_in_use(a) == 0 and blocks_in_use(b) == 0, 30, "KV blocks freed", procs)
    finally:
        if traffic is not None:
            traffic.stop()
        stop_all(procs)
        link_b.close()
        etcd.stop()


# --------------------------------------------------------------------------------------- NATS


def ask_cached(frontend, prefix: str, question: str) -> int:
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "system", "content": prefix}, {"role": "user", "content": question}])
    return r.usage.prompt_tokens_details.cached_tokens


def test_nats_restarted_under_traffic_events_resume_and_routers_recover_what_they_missed(tmp_path):
    nats = NatsServer(tmp_path / "nats.log")
    nats.start()
    env = base_env(str(tmp_path / "discovery"), ttl=TTL_S)
    workers = start_mocker("nats-workers", env, tmp_path, "--num-workers", "2", "--block-size", str(BLOCK),
                           "--speedup-ratio", "0", "--event-plane", "nats", "--nats-server", nats.url)
    live = start_frontend("nats-live-frontend", env, tmp_path, "--router-mode", "kv", "--migration-limit", "0")
    # The second router misses every event from before the restart until after it: it is
    # stopped (CPU-starved) meanwhile, so only recovery can teach it what the workers cached.
    starved = start_frontend("nats-starved-frontend", env, tmp_path, "--router-mode", "kv")
    procs = [workers, live, starved]
    traffic = None

    def applied(frontend) -> float:
        return metric(http_text(f"{frontend.url}/metrics"), "turbine_router_kv_events_applied_total")

    try:
        wait_until(lambda: worker_ready(workers), 60, "workers ready", procs)
        wait_until(lambda: instances_of(live, MODEL) == 2 and instances_of(starved, MODEL) == 2, 30,
                   "frontends see the workers", procs)
        traffic = Traffic(live.url, prompt=lambda tag: f"{uuid.uuid4()} {SYSTEM[:400]} {tag}").start()
        wait_until(lambda: traffic.ok >= 5 and applied(starved) > 0, 30, "events flowing", procs)
        os.kill(starved.popen.pid, signal.SIGSTOP)

        nats.stop()
        before = traffic.ok
        wait_until(lambda: traffic.ok >= before + 5, 30, "traffic during the NATS outage", procs)
        nats.start()
        # The workers' publishers and the live router's subscriber reconnect: events resume.
        resumed_at = applied(live)
        wait_until(lambda: applied(live) > resumed_at, 30, "events after the restart", procs)
        traffic.stop()
        print(f"NATS restart: {traffic.ok} requests, {len(traffic.failures)} failed")
        assert traffic.failures == [], summary(traffic)  # routing never needed NATS

        # Prefixes cached after the restart (the starved router still misses them).
        prefixes = [f"Conversation {n}. {SYSTEM}" for n in range(4)]
        for prefix in prefixes:
            ask_cached(live, prefix, "First question?")
        assert all(ask_cached(live, p, "Follow-up?") >= 10 * BLOCK for p in prefixes)  # live: right worker

        # Nothing is sent any more, so no later event can show the starved router a gap: it
        # recovers because its connection to NATS came back, asking each worker what it missed.
        os.kill(starved.popen.pid, signal.SIGCONT)
        wait_until(lambda: metric(http_text(f"{starved.url}/metrics"), "turbine_router_kv_event_recoveries_total") >= 1,
                   30, "the starved router recovered", procs)
        assert all(ask_cached(starved, p, "Another follow-up?") >= 10 * BLOCK for p in prefixes)
        text = http_text(f"{starved.url}/metrics")
        assert metric(text, "turbine_router_kv_event_recovery_failures_total") == 0
        print(f"NATS restart: the starved router recovered {metric(text, 'turbine_router_kv_event_recoveries_total'):.0f} "
              f"time(s), {metric(text, 'turbine_router_kv_events_applied_total'):.0f} events applied")
        wait_until(lambda: blocks_in_use(workers) == 0, 30, "KV blocks freed", procs)
    finally:
        if traffic is not None:
            traffic.stop()
        stop_all(procs)
        nats.stop()


# ----------------------------------------------------------------------------------- frontend


def test_frontend_restarted_under_traffic_fails_only_its_inflight_requests(tmp_path):
    env = base_env(str(tmp_path / "discovery"), ttl=TTL_S)
    workers = start_mocker("restart-workers", env, tmp_path, "--num-workers", "2")
    frontend = start_frontend("restart-frontend", env, tmp_path)
    procs = [workers, frontend]
    traffic = None
    try:
        wait_until(lambda: worker_ready(workers), 60, "workers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "frontend sees the workers", procs)
        # Streams long enough that some are always in flight when the frontend dies.
        traffic = Traffic(frontend.url, concurrency=4, max_tokens=100, stream=True).start()
        wait_until(lambda: traffic.ok >= 4 and traffic.in_flight == 4, 60, "streams in flight", procs)

        traffic.pause()
        in_flight = traffic.in_flight
        killed_at = time.monotonic()
        frontend.stop(signal.SIGKILL)
        wait_until(lambda: traffic.in_flight == 0, 60, "in-flight requests ended", [workers])
        assert worker_ready(workers)  # healthy while no frontend is there
        # Restarted on the same port: clients need no new address.
        again = start_frontend("restart-frontend-again", env, tmp_path, port=frontend.port)
        procs = [workers, again]
        wait_until(lambda: instances_of(again, MODEL) == 2, 60, "restarted frontend sees the workers", procs)
        restarted_ok = traffic.ok
        traffic.resume()
        wait_until(lambda: traffic.ok >= restarted_ok + 4, 60, "traffic through the new frontend", procs)
        traffic.stop()

        # Only requests in flight at the kill failed, each with a connection error.
        failures = traffic.failures
        print(f"frontend restart: {len(failures)} of {in_flight} in-flight requests failed; "
              f"{traffic.ok - restarted_ok} served after the restart")
        assert 1 <= len(failures) <= in_flight, summary(traffic)
        for started, _, exc in failures:
            assert started < killed_at
            assert isinstance(exc, (openai.APIConnectionError, httpx.TransportError)), repr(exc)
        # The workers never noticed more than cancelled requests: same process, healthy, no KV held.
        assert workers.alive()
        assert worker_ready(workers)
        wait_until(lambda: blocks_in_use(workers) == 0, 30, "KV blocks freed", procs)
        assert metric(http_text(f"{workers.url}/metrics"), "turbine_worker_inflight_requests") == 0
    finally:
        if traffic is not None:
            traffic.stop()
        stop_all(procs)
