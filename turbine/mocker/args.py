"""Mocker command line: the flags every Turbine worker has plus the simulated engine's,
turned into one typed MockerConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from turbine.mocker.kv_transfer import DEFAULT_BANDWIDTH_GB_S, KvTransferModel
from turbine.mocker.model_info import ModelInfo, read_model_info
from turbine.mocker.timing import TimingProfile, load_profile
from turbine.runtime.gc_pacing import DEFAULT_INTERVAL_S
from turbine.worker_config import ServingConfig, add_serving_args, serving_config_from_args


@dataclass(frozen=True)
class MockerConfig(ServingConfig):
    tokenizer_path: str  # local folder with the tokenizer files (for the model card)
    model_info: ModelInfo
    num_workers: int
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    natural_output_len: int
    speedup_ratio: float
    timing: TimingProfile
    kv_transfer: KvTransferModel  # decode workers: how long pulling a prompt's KV takes
    gc_interval: float  # seconds between paced garbage-collector passes; 0: Python's automatic collection
    kv_events_drop_after: int | None = None  # test hook: see --kv-events-drop-after


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m turbine.mocker",
        description="Simulated vLLM workers: the same endpoints, discovery records and model card as "
                    "python -m turbine.vllm, with a simulated scheduler and KV cache instead of a model.")
    p.add_argument("--model", default=None,
                   help="model whose tokenizer and config to use: an embedded name, a local Hugging Face "
                        "folder or a hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="default: the model name")
    sim = p.add_argument_group("simulated engine")
    sim.add_argument("--num-workers", type=int, default=1,
                     help="independent simulated workers in this process, each its own instance")
    sim.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV cache blocks per worker")
    sim.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    sim.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    sim.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    sim.add_argument("--max-model-len", type=int, default=None,
                     help="context length (default: the model's max_position_embeddings)")
    sim.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    sim.add_argument("--natural-output-len", type=int, default=128,
                     help="without ignore_eos, an answer ends with EOS after between half and one and a half "
                          "times this many tokens (deterministic per request); 0 = only max_tokens ends it")
    sim.add_argument("--speedup-ratio", type=float, default=1.0,
                     help="simulated time runs this many times faster than real time; 0 = steps take no time")
    sim.add_argument("--profile", default=None,
                     help="JSON file of step-time coefficients (see docs/mocker.md); default: built-in")
    sim.add_argument("--gc-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                     help="after start-up, Python's automatic garbage collection is off and a full pass runs "
                          f"every this many seconds (default {DEFAULT_INTERVAL_S:g}): the automatic passes "
                          "stall every simulated worker several times a second; 0 = leave it automatic")
    disagg = p.add_argument_group("simulated KV transfer (with --disaggregation-mode decode)")
    disagg.add_argument("--kv-bytes-per-token", type=int, default=None,
                        help="KV cache bytes per token pulled from a prefill worker (default: from the model's "
                             "config.json, 2 (K, V) x layers x KV heads x head dim x 2 bytes; SmolLM2-135M: 23040)")
    disagg.add_argument("--kv-transfer-bandwidth", type=float, default=DEFAULT_BANDWIDTH_GB_S, metavar="GB_PER_S",
                        help="KV transfer bandwidth between prefill and decode workers, in GB/s (default "
                             f"{DEFAULT_BANDWIDTH_GB_S:g}: a 200 Gb/s RDMA link); scaled by --speedup-ratio")
    hooks = p.add_argument_group("test hooks")
    hooks.add_argument("--kv-events-drop-after", type=int, default=None, metavar="N",
                       help="publish only the first N KV event batches, then drop the rest silently while "
                            "still announcing the publisher (0: none at all); for testing routers' "
                            "missing-events warnings, never for serving")
    add_serving_args(p)
    return p


def parse_mocker_args(argv: list[str] | None = None) -> MockerConfig:
    from turbine.model.prepare import tokenizer_folder

    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("num_workers", "num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.natural_output_len < 0:
        parser.error("--natural-output-len must be >= 0")
    if args.speedup_ratio < 0:
        parser.error("--speedup-ratio must be >= 0")
    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token < 1:
        parser.error("--kv-bytes-per-token must be >= 1")
    if args.gc_interval < 0:
        parser.error("--gc-interval must be >= 0 (seconds; 0 = automatic collection)")
    if not args.kv_transfer_bandwidth > 0:
        parser.error("--kv-transfer-bandwidth must be > 0 (GB/s)")
    if args.kv_events_drop_after is not None and args.kv_events_drop_after < 0:
        parser.error("--kv-events-drop-after must be >= 0")
    if args.num_workers > 1 and args.port:
        parser.error("--port: with --num-workers > 1 each worker needs its own port; leave --port at 0")
    try:
        timing = load_profile(args.profile) if args.profile else TimingProfile()
    except ValueError as exc:
        parser.error(f"--profile: {exc}")

    serving = serving_config_from_args(args, parser, args.served_model_name)
    try:
        tokenizer_path = tokenizer_folder(serving.model_path)
        info = read_model_info(tokenizer_path)
    except Exception as exc:  # hub and tokenizers errors have no common base class
        parser.error(f"--model {serving.model_path!r}: cannot read its tokenizer: {exc}")
    max_model_len = args.max_model_len or info.max_position_embeddings
    if not max_model_len or max_model_len < 2:
        parser.error("--max-model-len: give a context length of at least 2 (the model config has none)")
    # As vLLM does at start-up: one sequence of the full context must fit in the KV cache.
    if -(-max_model_len // args.block_size) > args.num_gpu_blocks:
        parser.error(f"--num-gpu-blocks {args.num_gpu_blocks} x --block-size {args.block_size} cannot hold one "
                     f"sequence of --max-model-len {max_model_len}")
    kv_bytes = args.kv_bytes_per_token or info.kv_bytes_per_token
    if kv_bytes is None and serving.is_decode:
        parser.error("--kv-bytes-per-token: the model's config.json does not give its KV size; give it")
    kv_transfer = KvTransferModel(bytes_per_token=kv_bytes or 0,
                                  bandwidth_bytes_per_s=args.kv_transfer_bandwidth * 1e9)

    return MockerConfig(
        **vars(serving), tokenizer_path=tokenizer_path, model_info=info,
        num_workers=args.num_workers, num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        natural_output_len=args.natural_output_len, speedup_ratio=args.speedup_ratio, timing=timing,
        kv_transfer=kv_transfer, gc_interval=args.gc_interval, kv_events_drop_after=args.kv_events_drop_after,
    )
