"""How long a simulated forward pass takes.

    step_ms = step_base_ms
            + prefill_ms_per_token * P + prefill_ms_per_token_pair * A
            + decode_ms_per_seq * B + decode_ms_per_kv_token * K

P: prompt tokens computed in the step (prefix-cache hits are not computed); A: the
attention work of those tokens, sum over sequences of p * (c + p / 2) for p new tokens on
top of c tokens already in the cache (each new token attends to the cached context and to
the new tokens before it; attention is quadratic per sequence, not over the whole batch);
B: sequences decoding one token; K: their context lengths summed (attention reads the whole
KV of each). An empty step takes no time.

The defaults model vLLM's CPU backend serving SmolLM2-135M on 2 cores (a calibrated profile
from `turbine mocker calibrate`, 2026-11-25). A profile JSON file (`--profile`) replaces any
of them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


# LoRA: the time to bring an adapter into one of the engine's active slots, added to the step that
# first needs it (--lora-load-time-ms). vLLM copies the adapter's weights into the least recently used
# of its max_loras slots before the forward pass. On the real vLLM CPU worker that the built-in profile
# models (SmolLM2-135M, 2 cores), swapping a rank-16 adapter of every linear module (20 MB) into its one
# slot did not make a one-token request measurably slower: -19 ms, medians of 50 against 50 requests
# of about 900 ms (benchmarks/routing/lora_swap_calibrate.py, docs/benchmarks/routing.md "Adapter-aware routing").
# So 0: the slots still limit which requests batch together. Give a GPU engine's copy time to model one.
DEFAULT_LORA_LOAD_TIME_MS = 0.0


class TimingProfile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    step_base_ms: float = 27.31
    prefill_ms_per_token: float = 1.199
    prefill_ms_per_token_pair: float = 0.000788
    decode_ms_per_seq: float = 1.346
    decode_ms_per_kv_token: float = 0.00467
    source: str = "built-in defaults (vLLM CPU, SmolLM2-135M, 2 cores; calibrated 2026-11-25)"

    def step_ms(self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_kv_tokens: int) -> float:
        if not prefill_tokens and not decode_seqs:
            return 0.0
        return (self.step_base_ms
                + self.prefill_ms_per_token * prefill_tokens
                + self.prefill_ms_per_token_pair * prefill_pairs
                + self.decode_ms_per_seq * decode_seqs
                + self.decode_ms_per_kv_token * decode_kv_tokens)


def attention_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Token pairs attended when `new_tokens` are computed on top of `cached_tokens`."""
    return new_tokens * (cached_tokens + new_tokens / 2)


def load_profile(path: str | Path) -> TimingProfile:
    """Read a profile JSON: an object with any of TimingProfile's fields (others are errors), or
    an engine profile ("format": "turbine-profile/1", turbine/planner/profile.py, what `turbine
    mocker calibrate` / `turbine profile` write), whose `timing` object is that."""
    try:
        raw = msgspec.json.decode(Path(path).read_bytes())
        if isinstance(raw, dict) and "format" in raw:
            if raw["format"] != "turbine-profile/1":
                raise ValueError(f"{path}: unknown profile format {raw['format']!r}")
            if not isinstance(raw.get("timing"), dict):
                raise ValueError(f"{path}: this engine profile has no 'timing' coefficients (write it with "
                                 f"`turbine mocker calibrate` or `turbine profile`)")
            raw = raw["timing"]
        if isinstance(raw, dict) and "prefill_ms_per_token_squared" in raw:
            # Profiles fitted before 2026-11-26 charged P² for a step's P prompt tokens; they
            # were measured on one prompt at a time, where P² = 2 × its attention pairs.
            raw.setdefault("prefill_ms_per_token_pair", 2 * raw.pop("prefill_ms_per_token_squared"))
        profile = msgspec.convert(raw, TimingProfile)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    for name in TimingProfile.__struct_fields__:
        value = getattr(profile, name)
        if isinstance(value, float) and value < 0:
            raise ValueError(f"{path}: {name} must be >= 0")
    return profile
