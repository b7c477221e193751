"""`turbine mocker calibrate`: measure a running worker and fit the mocker's timing profile.

It finds one live instance of the model in discovery and calls its `generate` endpoint
directly over the request plane, so the frontend's overhead is not counted as the engine's:
- prefill: one request at a time, max_tokens 1, a fresh random prompt of each length (so no
  prefix-cache hit); the time to first token is one step with P = the prompt length;
- prefill on a cached prefix: a prompt of C tokens (whole KV blocks) is sent first, then the
  same C tokens followed by P fresh ones: one step computing P tokens on top of C cached;
- decode: B requests at once with P-token prompts, ignore_eos; once all B decode together,
  the median gap between tokens is one step with B sequences and K = B x their context.
A least-squares fit (on relative error) of TimingProfile's coefficients (kept >= 0) over all measurements is
written, with the measurements themselves and the worker's limits, as an engine profile
(turbine/planner/profile.py, "turbine-profile/1"): the mocker's `--profile` reads its `timing`, the
planner interpolates its points. `turbine profile` is this same command. Run it on an otherwise
idle worker.

With `--url`, the same requests go through a frontend's OpenAI API with a streaming client
instead. Where the engine shares its cores with the serving path (a small CPU host), it runs
slower under a frontend and an HTTP client than it does alone, and a mocker meant to stand in
for it there should be calibrated that way: its own steps use no CPU to be slowed by them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass

import httpx
import msgspec

from turbine.config import (
    add_cluster_security_args,
    add_discovery_args,
    add_request_plane_args,
    cluster_security_from_args,
    discovery_config_from_args,
    make_registry,
    request_plane_from_args,
)
from turbine.flag_sources import env_errors
from turbine.mocker.model_info import read_model_info
from turbine.mocker.timing import TimingProfile, attention_pairs
from turbine.planner.profile import (
    DecodePoint,
    EngineLimits,
    EngineProfile,
    PrefillPoint,
    write_engine_profile,
)
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime.errors import RemoteError
from turbine.runtime.request_plane import new_client

COEFFICIENTS = ("step_base_ms", "prefill_ms_per_token", "prefill_ms_per_token_pair", "decode_ms_per_seq",
                "decode_ms_per_kv_token")


@dataclass(frozen=True)
class Measurement:
    """One observed step: its duration and what it computed."""

    ms: float
    prefill_tokens: int = 0
    cached_tokens: int = 0  # already in the cache when the prefill_tokens were computed
    decode_seqs: int = 0
    decode_kv_tokens: int = 0

    def features(self) -> list[float]:
        return [1.0, float(self.prefill_tokens), attention_pairs(self.prefill_tokens, self.cached_tokens),
                float(self.decode_seqs), float(self.decode_kv_tokens)]


def fit(measurements: list[Measurement]) -> dict[str, float]:
    """Least squares on relative error (each row divided by its measured time), the
    coefficients none negative: a coefficient that fits below zero is fixed at 0 and the rest
    are fitted again (an active-set loop; it ends within 5 rounds). Relative, because fidelity
    is judged relatively, and an absolute fit lets a 1.7 s prefill outweigh a 30 ms decode
    step (it left single-sequence decode 20 % fast)."""
    active = list(range(len(COEFFICIENTS)))
    while True:
        rows = [[m.features()[j] / max(m.ms, 1e-3) for j in active] for m in measurements]
        solution = _least_squares(rows, [1.0] * len(measurements))
        negative = [j for j, value in zip(active, solution) if value < 0]
        if not negative:
            coefficients = dict.fromkeys(COEFFICIENTS, 0.0)
            coefficients.update({COEFFICIENTS[j]: value for j, value in zip(active, solution)})
            return coefficients
        active.remove(min(negative, key=lambda j: solution[active.index(j)]))


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Solve the normal equations (columns scaled to unit size, so they are well conditioned)."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    a = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(rows, targets)) / scale[i] for i in range(n)]
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("the measurements cannot tell the coefficients apart; vary the sweep")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * y for x, y in zip(a[r], a[col])]
            b[r] -= f * b[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return [x[i] / scale[i] for i in range(n)]


class Prober:
    """Sends measured requests to one worker instance."""

    def __init__(self, record: InstanceRecord, vocab_size: int):
        self.record = record
        self.vocab_size = vocab_size
        self.client = new_client()
        self.rng = random.Random(0)

    def _prompt(self, length: int) -> list[int]:
        # Random ids away from the (usually low) special tokens: no two prompts share a prefix.
        return [self.rng.randrange(1000, self.vocab_size) for _ in range(length)]

    def _request(self, prompt_len: int, max_tokens: int, prefix: list[int] = ()) -> GenerateRequest:
        prompt = [*prefix, *self._prompt(prompt_len)]
        return GenerateRequest(request_id=f"calibrate-{uuid.uuid4().hex[:8]}", model="", token_ids=prompt,
                               stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))

    async def _arrivals(self, req: GenerateRequest) -> list[tuple[float, int]]:
        """(arrival time, tokens in the chunk) of each chunk of one stream."""
        arrivals = []
        stream = self.client.stream(self.record.address, self.record.endpoint, req, GenerateOutput)
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    arrivals.append((time.monotonic(), len(chunk.token_ids)))
        except RemoteError as exc:
            raise RuntimeError(f"the worker refused a calibration request: {exc.code}: {exc.message}") from exc
        return arrivals

    async def close(self) -> None:
        await self.client.close()

    async def prefill(self, prompt_len: int, cached_len: int = 0) -> Measurement:
        prefix = self._prompt(cached_len)
        if prefix:
            await self._arrivals(self._request(0, 1, prefix))  # now its whole blocks are cached
        started = time.monotonic()
        arrivals = await self._arrivals(self._request(prompt_len, 1, prefix))
        return Measurement(ms=(arrivals[0][0] - started) * 1000, prefill_tokens=prompt_len, cached_tokens=cached_len)

    async def decode(self, batch: int, prompt_len: int, tokens: int) -> Measurement:
        streams = await asyncio.gather(*(self._arrivals(self._request(prompt_len, tokens)) for _ in range(batch)))
        # The middle half of each stream: every sequence was admitted and none has finished.
        gaps = []
        for arrivals in streams:
            middle = arrivals[len(arrivals) // 4: 3 * len(arrivals) // 4 + 1]
            gaps += [(t1 - t0) / n for (t0, _), (t1, n) in zip(middle, middle[1:])]
        context = prompt_len + tokens / 2
        return Measurement(ms=statistics.median(gaps) * 1000, decode_seqs=batch,
                           decode_kv_tokens=round(batch * context))


class HttpProber(Prober):
    """Prober whose requests go through a frontend (`/v1/completions`, token-id prompts, streamed)."""

    def __init__(self, url: str, model: str, record: InstanceRecord, vocab_size: int):
        super().__init__(record, vocab_size)
        self.url, self.model = url.rstrip("/"), model
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))

    async def _arrivals(self, req: GenerateRequest) -> list[tuple[float, int]]:
        body = {"model": self.model, "prompt": req.token_ids, "max_tokens": req.stop.max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        arrivals, completion_tokens = [], None
        async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"the frontend refused a calibration request: HTTP {resp.status_code} "
                                   f"{(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = msgspec.json.decode(line[6:])
                if chunk.get("choices"):
                    arrivals.append((time.monotonic(), 1))
                if chunk.get("usage"):
                    completion_tokens = chunk["usage"]["completion_tokens"]
        if completion_tokens is None or not arrivals:
            raise RuntimeError("the frontend's stream ended without tokens or usage")
        if len(arrivals) != completion_tokens:
            # Some chunks carried several tokens (the client fell behind): keep the stream's
            # ends only, so the decode gap is the mean over the whole stream.
            arrivals = [arrivals[0], (arrivals[-1][0], completion_tokens - 1)] if len(arrivals) > 1 else arrivals
        return arrivals

    async def close(self) -> None:
        await self.http.aclose()
        await super().close()


async def find_instance(args) -> tuple[ModelCard, InstanceRecord]:
    registry = make_registry(args.discovery)
    await registry.backend.start()
    try:
        cards = [c for c in await registry.list_models()
                 if c.name == args.model and (args.namespace is None or c.namespace == args.namespace)]
        records = {r.path: r for r in await registry.list_instances()}
    finally:
        await registry.backend.close()
    for card in cards:
        record = records.get(card.path)
        if record is not None:
            return card, record
    raise LookupError(f"no live worker serves the model {args.model!r}")


async def calibrate(args) -> EngineProfile:
    card, record = await find_instance(args)
    vocab = read_model_info(card.tokenizer_path).vocab_size
    prober = HttpProber(args.url, card.name, record, vocab) if args.url else Prober(record, vocab)
    longest = min(card.max_num_batched_tokens, card.context_length - 2)  # one step, one prompt
    measurements: list[Measurement] = []
    for prompt_len in (p for p in args.prompt_lens if p <= longest):
        # Noise only ever adds time: the fastest run is the best estimate.
        runs = [await prober.prefill(prompt_len) for _ in range(args.repeats)]
        measurements.append(min(runs, key=lambda m: m.ms))
        print(f"prefill {prompt_len:6d} tokens: {measurements[-1].ms:8.1f} ms", file=sys.stderr)
    for cached_len in args.cached_prefix_lens:
        cached_len -= cached_len % card.kv_block_size  # only whole blocks are cached
        prompt_len = args.cached_prefill_len
        if not cached_len or cached_len + prompt_len > card.context_length - 2:
            continue
        runs = [await prober.prefill(prompt_len, cached_len) for _ in range(args.repeats)]
        measurements.append(min(runs, key=lambda m: m.ms))
        print(f"prefill {prompt_len:6d} tokens on {cached_len} cached: {measurements[-1].ms:8.1f} ms", file=sys.stderr)
    for batch in (b for b in args.batch_sizes if b <= card.max_num_seqs):
        for prompt_len in args.decode_prompt_lens:
            m = await prober.decode(batch, prompt_len, args.decode_tokens)
            measurements.append(m)
            print(f"decode batch {batch:3d}, prompt {prompt_len:5d}: {m.ms:8.1f} ms/token", file=sys.stderr)
    await prober.close()
    via = f" through the frontend at {args.url}" if args.url else ""
    source = (f"turbine mocker calibrate: model {card.name!r} ({card.engine}) instance {card.instance_id}{via}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    timing = TimingProfile(**fit(measurements), source=source)
    return engine_profile(card, measurements, timing)


def engine_profile(card: ModelCard, measurements: list[Measurement], timing: TimingProfile) -> EngineProfile:
    """The sweep as the file both the planner and the mocker read."""
    return EngineProfile(
        source=timing.source,
        engine=EngineLimits(max_num_seqs=card.max_num_seqs, max_num_batched_tokens=card.max_num_batched_tokens,
                            kv_tokens=card.total_kv_blocks * card.kv_block_size, context_length=card.context_length),
        prefill=[PrefillPoint(prompt_tokens=m.prefill_tokens, ms=round(m.ms, 3), cached_tokens=m.cached_tokens)
                 for m in measurements if m.prefill_tokens],
        decode=[DecodePoint(batch=m.decode_seqs, kv_tokens=m.decode_kv_tokens, ms=round(m.ms, 3))
                for m in measurements if m.decode_seqs],
        timing=msgspec.structs.asdict(timing))


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser(prog: str = "turbine mocker calibrate") -> argparse.ArgumentParser:
    with env_errors(prog):  # a bad TURBINE_* value: one line naming it
        return _build_parser(prog)


def _build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Measure a running worker and write its engine profile (JSON): "
                                                       "the planner's performance model and the mocker's --profile.")
    p.add_argument("--model", required=True, help="served model name of the worker to measure")
    p.add_argument("--namespace", default=None, help="only instances of this namespace")
    p.add_argument("--output", required=True, help="where to write the profile JSON")
    p.add_argument("--url", default=None,
                   help="measure through this frontend (base URL, e.g. http://127.0.0.1:8000) with a streaming "
                        "HTTP client, as a benchmark's client sees the engine; default: the worker's request "
                        "plane directly")
    p.add_argument("--prompt-lens", type=_int_list, default=[32, 128, 512, 1024, 2048],
                   help="prefill sweep: prompt lengths (longer than one step's budget are skipped)")
    p.add_argument("--repeats", type=int, default=3, help="prefill runs per length; the fastest counts")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 16], help="decode sweep: concurrent requests")
    p.add_argument("--cached-prefix-lens", type=_int_list, default=[512, 1024],
                   help="prefill on a cached prefix: prefix lengths (rounded down to whole KV blocks)")
    p.add_argument("--cached-prefill-len", type=int, default=128,
                   help="prefill on a cached prefix: fresh tokens after the prefix")
    p.add_argument("--decode-prompt-lens", type=_int_list, default=[64, 512, 1024],
                   help="decode sweep: prompt lengths (they set the KV tokens read per step)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode request")
    add_discovery_args(p)
    add_cluster_security_args(p, listens=False)
    add_request_plane_args(p.add_argument_group("Turbine request plane"))
    return p


def main(argv: list[str] | None = None, prog: str = "turbine mocker calibrate") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.decode_tokens < 8:
        parser.error("--decode-tokens must be >= 8 (the middle half of each stream is measured)")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        parser.error(f"--url {args.url!r}: expected an http:// or https:// base URL")
    args.discovery = discovery_config_from_args(args, parser)
    from turbine.runtime import cluster_auth

    cluster_auth.install(cluster_security_from_args(args, parser).auth())  # to reach the worker's request plane
    request_plane_from_args(args, parser).install()
    try:
        profile = asyncio.run(calibrate(args))
    except (LookupError, ValueError, RuntimeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    write_engine_profile(profile, args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
