"""How long a simulated forward pass takes.

    step_ms = step_base_ms
            + prefill_ms_per_token * P + prefill_ms_per_token_squared * P**2
            + decode_ms_per_seq * B + decode_ms_per_kv_token * K

P: prompt tokens computed in the step (prefix-cache hits are not computed, so they cost
nothing); B: sequences decoding one token; K: their context lengths summed (attention
reads the whole KV of each). An empty step takes no time.

The defaults model vLLM's CPU backend serving SmolLM2-135M on 2 cores. step_base_ms and
prefill_ms_per_token come from one measured point (aiperf at concurrency 1, 286 prompt
tokens, 64 output tokens, prefix caching off: TTFT p50 about 430 ms, ITL p50 about 35 ms);
the batch, KV and quadratic terms are not measured yet (guesses). A profile JSON file
(`--profile`) replaces any of them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class TimingProfile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    step_base_ms: float = 31.0
    prefill_ms_per_token: float = 1.4
    prefill_ms_per_token_squared: float = 0.0
    decode_ms_per_seq: float = 2.0
    decode_ms_per_kv_token: float = 0.005
    source: str = "built-in defaults (vLLM CPU, SmolLM2-135M, 2 cores; partly guessed)"

    def step_ms(self, prefill_tokens: int, decode_seqs: int, decode_kv_tokens: int) -> float:
        if not prefill_tokens and not decode_seqs:
            return 0.0
        return (self.step_base_ms
                + self.prefill_ms_per_token * prefill_tokens
                + self.prefill_ms_per_token_squared * prefill_tokens * prefill_tokens
                + self.decode_ms_per_seq * decode_seqs
                + self.decode_ms_per_kv_token * decode_kv_tokens)


def load_profile(path: str | Path) -> TimingProfile:
    """Read a profile JSON: an object with any of TimingProfile's fields (others are errors)."""
    try:
        profile = msgspec.json.decode(Path(path).read_bytes(), type=TimingProfile)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{path}: {exc}") from None
    for name in TimingProfile.__struct_fields__:
        value = getattr(profile, name)
        if isinstance(value, float) and value < 0:
            raise ValueError(f"{path}: {name} must be >= 0")
    return profile
