"""A steady stream of streamed completions through a frontend, with the official openai client,
that counts every request that did not end whole (for the planner's scale-up / scale-down tests)."""

from __future__ import annotations

import random
import threading
import time

from openai import OpenAI


class SteadyTraffic:
    """`clients` threads, each sending one streamed completion after another (with `pause_s`
    between them) until stop(): every answer must come whole (finish_reason "length", all
    `max_tokens` tokens, one response id), anything else is a failure."""

    def __init__(self, url: str, model: str, clients: int = 4, tokens: tuple[int, int] = (20, 60),
                 pause_s: float = 0.05, seed: int = 0):
        self.url, self.model, self.tokens, self.pause_s = url, model, tokens, pause_s
        self.ok = 0
        self.failures: list[str] = []
        self.done_times: list[float] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        client = OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)
        while not self._stop.is_set():
            want = rng.randint(*self.tokens)
            prompt = f"Request {rng.random()}: tell me about lighthouses."
            try:
                got, finish, ids = 0, None, set()
                stream = client.completions.create(model=self.model, prompt=prompt, max_tokens=want, stream=True,
                                                   logprobs=0, extra_body={"ignore_eos": True})
                for chunk in stream:
                    ids.add(chunk.id)
                    for choice in chunk.choices:
                        got += len(choice.logprobs.tokens or []) if choice.logprobs else 0
                        finish = choice.finish_reason or finish
                if (got, finish, len(ids)) != (want, "length", 1):
                    raise AssertionError(f"incomplete: {got}/{want} tokens, finish {finish}, {len(ids)} ids")
                with self._lock:
                    self.ok += 1
                    self.done_times.append(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
            time.sleep(self.pause_s)

    def completed_since(self, t: float) -> int:
        with self._lock:
            return sum(d >= t for d in self.done_times)

    def stop(self, timeout: float = 120) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a traffic thread hangs"
