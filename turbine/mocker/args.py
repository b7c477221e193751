"""Mocker command line: the flags every Turbine worker has plus the simulated engine's,
turned into one typed MockerConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from turbine.config import check, flag
from turbine.flag_sources import add_config_arg, env_errors, env_forms, with_config_file
from turbine.logging_setup import add_logging_args
from turbine.mocker.kv_tiers import DEFAULT_DISK_BANDWIDTH_GB_S, DEFAULT_HOST_BANDWIDTH_GB_S, TierSpec
from turbine.mocker.kv_transfer import DEFAULT_BANDWIDTH_GB_S, KvTransferModel
from turbine.mocker.model_info import ModelInfo, read_model_info
from turbine.mocker.timing import DEFAULT_LORA_LOAD_TIME_MS, TimingProfile, load_profile
from turbine.model.prepare import tokenizer_folder
from turbine.runtime.gc_pacing import DEFAULT_INTERVAL_S
from turbine.tracing import add_tracing_args
from turbine.worker.config import EMBEDDINGS, ServingConfig, add_serving_args, checked, serving_fields_from_args


GIB = 1 << 30  # the real worker's --kv-*-cache-gb are GiB too (turbine/vllm/connectors.py)


@dataclass(frozen=True, kw_only=True)
class MockerConfig(ServingConfig):
    tokenizer_path: str  # local folder with the tokenizer files (for the model card)
    model_info: ModelInfo
    num_workers: int = flag("--num-workers", default=1)
    data_parallel_size: int = flag("--data-parallel-size", default=1)  # engines (ranks) per worker
    num_gpu_blocks: int = flag("--num-gpu-blocks", default=16384)  # per engine
    block_size: int = flag("--block-size", default=64)
    max_num_seqs: int = flag("--max-num-seqs", default=256)
    max_num_batched_tokens: int = flag("--max-num-batched-tokens", default=8192)
    max_model_len: int = flag("--max-model-len")
    enable_prefix_caching: bool = flag("--enable-prefix-caching", default=True)
    natural_output_len: int = flag("--natural-output-len", default=128)
    speedup_ratio: float = flag("--speedup-ratio", default=1.0)
    # Seconds (real time, not scaled) the simulated engine takes to start before it registers.
    startup_time: float = flag("--startup-time", default=0.0)
    # Seconds (real time, not scaled) a sleep and a wake take, as a GPU engine's (docs/benchmarks/gpu.md,
    # "Sleep / wake of the vLLM engine on a GPU": level 1 on an H100, ~0.4 s to sleep, ~0.6 s to wake).
    sleep_time: float = flag("--sleep-time", default=0.0)
    wake_time: float = flag("--wake-time", default=0.0)
    timing: TimingProfile = flag("--profile", default_factory=TimingProfile)
    # Decode workers: how long pulling a prompt's KV takes. None: the model config's KV size.
    kv_bytes_per_token: int | None = flag("--kv-bytes-per-token", default=None)
    kv_transfer_bandwidth: float = flag("--kv-transfer-bandwidth", default=DEFAULT_BANDWIDTH_GB_S)  # GB/s
    # Seconds between paced garbage-collector passes; 0: Python's automatic collection.
    gc_interval: float = flag("--gc-interval", default=DEFAULT_INTERVAL_S)
    # Every answer is this text's tokens (then EOS) instead of random words; None: random words.
    reply_text: str | None = flag("--reply-text", default=None)
    kv_events_drop_after: int | None = flag("--kv-events-drop-after", default=None)  # test hook
    # LoRA adapters (as vLLM's flags): loaded by the shared worker host (turbine/worker/lora.py);
    # the mocker checks and records them, and serves requests naming one it holds.
    enable_lora: bool = flag("--enable-lora", default=False)
    max_lora_rank: int = flag("--max-lora-rank", default=16)
    # Each step holds requests of at most max_loras distinct adapters, kept in that many active slots
    # (an LRU); bringing one into a slot costs lora_load_time_ms (timing.py).
    max_loras: int | None = flag("--max-loras", default=None)  # None: vLLM's default, 1
    lora_load_time_ms: float | None = flag("--lora-load-time-ms", default=None)  # None: DEFAULT_LORA_LOAD_TIME_MS
    # KV tiers (the real worker's --connector kvbm, simulated: kv_tiers.py), in GiB as the real worker's flags;
    # the bandwidths in GB/s, None: the defaults measured on the real tiers.
    kv_host_cache_gb: float | None = flag("--kv-host-cache-gb", default=None)
    kv_disk_cache_gb: float | None = flag("--kv-disk-cache-gb", default=None)
    kv_host_bandwidth: float | None = flag("--kv-host-bandwidth", default=None)
    kv_disk_bandwidth: float | None = flag("--kv-disk-bandwidth", default=None)

    def __post_init__(self):
        super().__post_init__()
        check(self, EMBEDDINGS not in self.endpoint_types, "endpoint_types",
              "the mocker simulates generation only; it serves no embeddings")
        for name in ("num_workers", "data_parallel_size", "num_gpu_blocks", "block_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            check(self, getattr(self, name) >= 1, name, "must be >= 1")
        check(self, self.natural_output_len >= 0, "natural_output_len", "must be >= 0")
        check(self, self.speedup_ratio >= 0, "speedup_ratio", "must be >= 0")
        check(self, self.startup_time >= 0, "startup_time", "must be >= 0 (seconds)")
        check(self, self.sleep_time >= 0, "sleep_time", "must be >= 0 (seconds)")
        check(self, self.wake_time >= 0, "wake_time", "must be >= 0 (seconds)")
        check(self, self.kv_bytes_per_token is None or self.kv_bytes_per_token >= 1, "kv_bytes_per_token",
              "must be >= 1")
        check(self, self.gc_interval >= 0, "gc_interval", "must be >= 0 (seconds; 0 = automatic collection)")
        check(self, self.reply_text is None or bool(self.reply_text), "reply_text", "must not be empty")
        check(self, self.kv_transfer_bandwidth > 0, "kv_transfer_bandwidth", "must be > 0 (GB/s)")
        check(self, self.kv_events_drop_after is None or self.kv_events_drop_after >= 0, "kv_events_drop_after",
              "must be >= 0")
        check(self, self.num_workers == 1 or not self.port, "port",
              "with --num-workers > 1 each worker needs its own port; leave --port at 0")
        check(self, self.max_model_len >= 2, "max_model_len",
              "give a context length of at least 2 (the model config has none)")
        # As vLLM does at start-up: one sequence of the full context must fit in the KV cache.
        for name in ("max_loras", "lora_load_time_ms"):
            check(self, self.enable_lora or getattr(self, name) is None, name, "needs --enable-lora")
        check(self, self.max_loras is None or self.max_loras >= 1, "max_loras", "must be >= 1")
        check(self, self.lora_load_time_ms is None or self.lora_load_time_ms >= 0, "lora_load_time_ms",
              "must be >= 0 (milliseconds)")
        check(self, -(-self.max_model_len // self.block_size) <= self.num_gpu_blocks, "num_gpu_blocks",
              f"{self.num_gpu_blocks} x --block-size {self.block_size} cannot hold one sequence of "
              f"--max-model-len {self.max_model_len}")
        check(self, not self.is_decode or self.kv_transfer.bytes_per_token >= 1, "kv_bytes_per_token",
              "the model's config.json does not give its KV size; give it")
        check(self, self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        check(self, self.enable_lora or not self.lora_modules, "lora_modules", "needs --enable-lora")
        self._check_tiers()

    def _check_tiers(self) -> None:
        for tier in ("host", "disk"):
            gb, bandwidth = getattr(self, f"kv_{tier}_cache_gb"), getattr(self, f"kv_{tier}_bandwidth")
            check(self, gb is None or gb > 0, f"kv_{tier}_cache_gb", "must be > 0 (GiB)")
            check(self, bandwidth is None or gb is not None, f"kv_{tier}_bandwidth", f"needs --kv-{tier}-cache-gb")
            check(self, bandwidth is None or bandwidth > 0, f"kv_{tier}_bandwidth", "must be > 0 (GB/s)")
        if self.kv_host_cache_gb is None and self.kv_disk_cache_gb is None:
            return
        name = "kv_host_cache_gb" if self.kv_host_cache_gb is not None else "kv_disk_cache_gb"
        # As the real worker (--connector kvbm nixl on prefill workers only): a decode worker's prompt KV
        # comes from its prefill worker.
        check(self, not self.is_decode, name,
              "a decode worker takes its prompts' KV from prefill workers: the KV tiers go on aggregated or "
              "prefill workers")
        # Without prefix caching no block is named, offloaded or found again.
        check(self, self.enable_prefix_caching, name, "the KV tiers need --enable-prefix-caching")
        check(self, self.kv_block_bytes >= 1, "kv_bytes_per_token",
              "the model's config.json does not give its KV size, which the tiers' capacity and load time need; "
              "give it")
        for spec_gb, tier in ((self.kv_host_cache_gb, "host"), (self.kv_disk_cache_gb, "disk")):
            if spec_gb is not None:
                check(self, spec_gb * GIB // self.kv_block_bytes >= 1, f"kv_{tier}_cache_gb",
                      f"{spec_gb:g} GiB holds no block of {self.kv_block_bytes} bytes")

    @property
    def lora_slots(self) -> int:
        """Active adapter slots per engine (0: LoRA off)."""
        return (self.max_loras or 1) if self.enable_lora else 0

    @property
    def lora_load_ms(self) -> float:
        return DEFAULT_LORA_LOAD_TIME_MS if self.lora_load_time_ms is None else self.lora_load_time_ms

    @property
    def kv_block_bytes(self) -> int:
        """KV bytes of one block (0: unknown)."""
        return (self.kv_bytes_per_token or self.model_info.kv_bytes_per_token or 0) * self.block_size

    @property
    def kv_tiers(self) -> list[TierSpec]:
        """The simulated KV tiers of each engine, fastest first (none: no tiers)."""
        out = []
        for tier, gb, bandwidth, default in (
                ("host", self.kv_host_cache_gb, self.kv_host_bandwidth, DEFAULT_HOST_BANDWIDTH_GB_S),
                ("disk", self.kv_disk_cache_gb, self.kv_disk_bandwidth, DEFAULT_DISK_BANDWIDTH_GB_S)):
            if gb is not None:
                out.append(TierSpec(tier, int(gb * GIB // self.kv_block_bytes), (bandwidth or default) * 1e9))
        return out

    @property
    def kv_transfer(self) -> KvTransferModel:
        """Decode workers: how long pulling a prompt's KV takes."""
        return KvTransferModel(bytes_per_token=self.kv_bytes_per_token or self.model_info.kv_bytes_per_token or 0,
                               bandwidth_bytes_per_s=self.kv_transfer_bandwidth * 1e9)


def build_parser() -> argparse.ArgumentParser:
    with env_errors("python -m turbine.mocker"):
        return _build_parser()


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m turbine.mocker",
        description="Simulated vLLM workers: the same endpoints, discovery records and model card as "
                    "python -m turbine.vllm, with a simulated scheduler and KV cache instead of a model.")
    add_config_arg(p)
    p.add_argument("--model", default=None,
                   help="model whose tokenizer and config to use: an embedded name, a local Hugging Face "
                        "folder or a hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="default: the model name")
    # The vLLM worker's text mode: refused by name (the mocker has no tokenizer to render text with).
    p.add_argument("--use-vllm-tokenizer", action="store_true", help=argparse.SUPPRESS)
    sim = p.add_argument_group("simulated engine")
    sim.add_argument("--num-workers", type=int, default=1,
                     help="independent simulated workers in this process, each its own instance")
    sim.add_argument("--data-parallel-size", type=int, default=1,
                     help="engines (data-parallel ranks) per simulated worker, each with its own KV cache and "
                          "scheduler; a request's dp_rank picks one (none given: the least loaded)")
    sim.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV cache blocks per engine")
    sim.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    sim.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    sim.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    sim.add_argument("--max-model-len", type=int, default=None,
                     help="context length (default: the model's max_position_embeddings)")
    sim.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse cached KV blocks of earlier prompts' prefixes (default on)")
    sim.add_argument("--natural-output-len", type=int, default=128,
                     help="without ignore_eos, an answer ends with EOS after between half and one and a half "
                          "times this many tokens (deterministic per request); 0 = only max_tokens ends it")
    sim.add_argument("--reply-text", default=None, metavar="TEXT",
                     help="every answer is this text's tokens and then EOS (with ignore_eos it repeats until "
                          "max_tokens) instead of random words, whatever the prompt: e.g. a tool call, to "
                          "measure or test output parsers; --natural-output-len does not apply")
    sim.add_argument("--speedup-ratio", type=float, default=1.0,
                     help="simulated time runs this many times faster than real time; 0 = steps take no time")
    sim.add_argument("--startup-time", type=float, default=0.0, metavar="SECONDS",
                     help="the simulated engine takes this long to start (real seconds, not scaled by "
                          "--speedup-ratio) before the worker registers, as a real engine loads its model: "
                          "meanwhile /live answers and /health says starting (default 0)")
    sim.add_argument("--sleep-time", type=float, default=0.0, metavar="SECONDS",
                     help="a sleep (/engine/sleep) frees the simulated KV cache and then takes this long "
                          "(real seconds, not scaled), as a GPU engine's: a level-1 sleep of vLLM on an H100 "
                          "took ~0.4 s after the first (default 0)")
    sim.add_argument("--wake-time", type=float, default=0.0, metavar="SECONDS",
                     help="a wake (/engine/wake_up) takes this long (real seconds, not scaled) before the worker "
                          "registers again: a level-1 wake of vLLM on an H100 took 0.6 s (default 0)")
    sim.add_argument("--profile", default=None,
                     help="JSON file of step-time coefficients (see docs/mocker.md); default: built-in")
    sim.add_argument("--gc-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                     help="after start-up, Python's automatic garbage collection is off and a full pass runs "
                          f"every this many seconds (default {DEFAULT_INTERVAL_S:g}): the automatic passes "
                          "stall every simulated worker several times a second; 0 = leave it automatic")
    disagg = p.add_argument_group("simulated KV transfer (with --disaggregation-mode decode)")
    disagg.add_argument("--kv-bytes-per-token", type=int, default=None,
                        help="KV cache bytes per token, pulled from a prefill worker or loaded from the KV tiers "
                             "(default: from the model's config.json, 2 (K, V) x layers x KV heads x head dim x 2 "
                             "bytes; SmolLM2-135M: 23040; the real CPU worker's float32: 46080)")
    disagg.add_argument("--kv-transfer-bandwidth", type=float, default=DEFAULT_BANDWIDTH_GB_S, metavar="GB_PER_S",
                        help="KV transfer bandwidth between prefill and decode workers, in GB/s (default "
                             f"{DEFAULT_BANDWIDTH_GB_S:g}: a 200 Gb/s RDMA link); scaled by --speedup-ratio")
    lora = p.add_argument_group("LoRA adapters (as vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="take LoRA adapters (load_lora / POST /v1/loras, --lora-modules): each is checked "
                           "(adapter_config.json, safetensors, the model's shapes) and recorded")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank taken")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="active adapter slots per engine (default 1, as vLLM): a step holds requests of at most "
                           "this many distinct adapters; the slots are an LRU")
    lora.add_argument("--lora-load-time-ms", type=float, default=None, metavar="MS",
                      help="simulated time to bring an adapter into a slot, added to the step that first needs it "
                           f"(default {DEFAULT_LORA_LOAD_TIME_MS:g}: see docs/mocker.md; scaled by --speedup-ratio)")
    tiers = p.add_argument_group(
        "simulated KV tiers (the vLLM worker's --connector kvbm: blocks the engine computes are kept in these "
        "tiers too, and a prompt continuing past the engine's prefix cache loads them instead of recomputing)")
    tiers.add_argument("--kv-host-cache-gb", type=float, default=None,
                       help="host-memory tier per engine, in GiB of KV (blocks of --kv-bytes-per-token x "
                            "--block-size bytes), LRU")
    tiers.add_argument("--kv-disk-cache-gb", type=float, default=None,
                       help="local-disk tier per engine, in GiB (simulated: no directory), LRU; a block loaded "
                            "from it is copied into the host tier")
    tiers.add_argument("--kv-host-bandwidth", type=float, default=None, metavar="GB_PER_S",
                       help=f"loading from the host tier, in GB/s (default {DEFAULT_HOST_BANDWIDTH_GB_S:g}, measured "
                            "on the real tiers: docs/mocker.md); scaled by --speedup-ratio")
    tiers.add_argument("--kv-disk-bandwidth", type=float, default=None, metavar="GB_PER_S",
                       help=f"loading from the disk tier, in GB/s (default {DEFAULT_DISK_BANDWIDTH_GB_S:g}, measured "
                            "from the page cache)")
    before = len(p._actions)
    add_logging_args(p)
    add_tracing_args(p)
    observability = p._actions[before:]  # their variables are their own (TURBINE_LOG_LEVEL, OTEL_*)
    hooks = p.add_argument_group("test hooks")
    hooks.add_argument("--kv-events-drop-after", type=int, default=None, metavar="N",
                       help="publish only the first N KV event batches, then drop the rest silently while "
                            "still announcing the publisher (0: none at all); for testing routers' "
                            "missing-events warnings, never for serving")
    add_serving_args(p)
    env_forms([a for a in p._actions if a not in observability])  # TURBINE_<FLAG> for every flag
    return p


def parse_mocker_args(argv: list[str] | None = None) -> MockerConfig:
    """Read the flags (and the model's tokenizer and config); MockerConfig checks the values."""
    parser = build_parser()
    args = parser.parse_args(with_config_file(parser, argv))
    if args.use_vllm_tokenizer:
        parser.error("--use-vllm-tokenizer: text mode is not supported by the mocker (it simulates a token-in, "
                     "token-out worker)")
    try:
        timing = load_profile(args.profile) if args.profile else TimingProfile()
    except ValueError as exc:
        parser.error(f"--profile: {exc}")
    serving = serving_fields_from_args(args, parser, args.served_model_name)
    try:
        tokenizer_path = tokenizer_folder(serving["model_path"])
        info = read_model_info(tokenizer_path)
    except Exception as exc:  # hub and tokenizers errors have no common base class
        parser.error(f"--model {serving['model_path']!r}: cannot read its tokenizer: {exc}")
    return checked(
        MockerConfig, parser, **serving, tokenizer_path=tokenizer_path, model_info=info,
        num_workers=args.num_workers, data_parallel_size=args.data_parallel_size,
        num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or info.max_position_embeddings or 0,
        enable_prefix_caching=args.enable_prefix_caching, natural_output_len=args.natural_output_len,
        speedup_ratio=args.speedup_ratio, startup_time=args.startup_time, sleep_time=args.sleep_time,
        wake_time=args.wake_time, timing=timing, kv_bytes_per_token=args.kv_bytes_per_token,
        kv_transfer_bandwidth=args.kv_transfer_bandwidth, gc_interval=args.gc_interval,
        kv_events_drop_after=args.kv_events_drop_after, reply_text=args.reply_text,
        enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
        lora_load_time_ms=args.lora_load_time_ms, kv_host_cache_gb=args.kv_host_cache_gb,
        kv_disk_cache_gb=args.kv_disk_cache_gb, kv_host_bandwidth=args.kv_host_bandwidth,
        kv_disk_bandwidth=args.kv_disk_bandwidth,
    )

