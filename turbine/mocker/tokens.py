"""What the simulated model "generates": deterministic token ids, so a test can replay a
request and get the same output.

The token at output position p of choice i is a hash of (prompt, i, p), drawn from the
model's whole-word tokens when it has them (" the", " cat", ...), else from the vocabulary
minus its special tokens. Word tokens make the answer text encode back to the very tokens
that were generated, as a real model's answers mostly do: a chat client that sends the
answer back in its next turn then finds it in the prefix cache, where the engine put it
while decoding (random ids would decode to text that encodes differently, so no turn would
ever reuse an answer). EOS comes
only where the simulated answer ends naturally: after a length drawn, again from the
hash, between half and one and a half times `natural_output_len` (0 = never). The
request's stop_token_ids are never drawn before min_tokens (vLLM masks them until then).

With a fixed reply (`--reply-text`, a simulator option for benchmarks and tests of output
parsers) every answer is that text's tokens and then EOS (with ignore_eos the text repeats
until max_tokens), whatever the prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an integer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def prompt_seed(prompt: Sequence[int]) -> int:
    return int.from_bytes(hashlib.blake2b(array("I", prompt).tobytes(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Choice:
    """One choice's generation state that the sampler needs."""

    seed: int  # prompt_seed of the request
    index: int  # choice index (n > 1)
    min_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool


class TokenSampler:
    # Fewer word tokens than this: draw from all ordinary tokens (a toy vocabulary).
    MIN_WORD_TOKENS = 256

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], special_token_ids: Sequence[int],
                 natural_output_len: int, word_token_ids: Sequence[int] = (), reply_token_ids: Sequence[int] = ()):
        excluded = set(special_token_ids) | set(eos_token_ids)
        words = [t for t in word_token_ids if t not in excluded and 0 <= t < vocab_size]
        self._ordinary = (words if len(words) >= self.MIN_WORD_TOKENS
                          else [t for t in range(vocab_size) if t not in excluded])
        if not self._ordinary:
            raise ValueError("the vocabulary has no ordinary (non-special) tokens")
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.natural_output_len = natural_output_len
        self.reply = list(reply_token_ids)

    def answer_len(self, choice: Choice) -> int | None:
        """How many tokens the simulated answer has, EOS included; None = it never ends."""
        if self.reply:
            return None if choice.ignore_eos or self.eos_token_id is None else len(self.reply) + 1
        n = self.natural_output_len
        if n <= 0 or choice.ignore_eos or self.eos_token_id is None:
            return None
        h = _mix(choice.seed ^ ((choice.index + 1) * 0x9E3779B97F4A7C15 & _MASK64))
        drawn = (n + 1) // 2 + h % (n + 1)
        return max(drawn, choice.min_tokens, 1)

    def token(self, choice: Choice, position: int, answer_len: int | None) -> int:
        """The token at output `position` (0-based)."""
        if answer_len is not None and position + 1 >= answer_len:
            return self.eos_token_id
        if self.reply:
            return self.reply[position % len(self.reply)]
        ordinary = self._ordinary
        h = _mix((choice.seed + (choice.index << 40) + position) & _MASK64)
        token = ordinary[h % len(ordinary)]
        stops = choice.stop_token_ids
        if position < choice.min_tokens and token in stops:
            # Masked until min_tokens, as in vLLM: take the next ordinary token that is no stop
            # token (bounded, so a request listing the whole vocabulary cannot spin forever).
            for step in range(1, min(len(stops) + 1, len(ordinary))):
                token = ordinary[(h + step) % len(ordinary)]
                if token not in stops:
                    break
        return token
