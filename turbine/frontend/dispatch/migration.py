"""Request migration, the frontend's policy: whether a request whose worker failed may go on
on another worker, and the request that continues it there (the dispatch stage does it).

A continuation is the original prompt plus the tokens generated so far, with max_tokens and
min_tokens reduced by what was generated: the new worker computes the extended prompt and
generates the rest, and the client's stream goes on where it stopped. Postprocess works on
token ids, so detokenizing, stop strings and usage see one unbroken sequence.

What cannot continue once it has generated (it can still move before its first token):
n > 1 (each choice has its own tokens), structured outputs (the grammar's state is not
sent), prompt embeddings and text mode (there are no prompt token ids to extend).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from turbine.config import check, flag
from turbine.protocol import errors as codes
from turbine.protocol.generate import GenerateRequest
from turbine.runtime.errors import PeerDisconnected, RemoteError

DISCONNECTED = "disconnected"  # the reason of a worker gone without a word (killed, crashed, cut off)


@dataclass(frozen=True)
class MigrationConfig:
    # Times one request may move to another worker. None: each model's card decides (a worker's
    # --migration-limit, default 0); set here, it applies to every model.
    limit: int | None = flag("--migration-limit", default=None)
    # A request whose prompt plus generated tokens exceed this is not migrated (recomputing
    # them elsewhere costs too much). None: no bound.
    max_seq_len: int | None = flag("--migration-max-seq-len", default=None)

    def __post_init__(self):
        check(self, self.limit is None or self.limit >= 0, "limit", "must be >= 0")
        check(self, self.max_seq_len is None or self.max_seq_len >= 1, "max_seq_len", "must be >= 1")

    def limit_for(self, card_limit: int) -> int:
        return card_limit if self.limit is None else self.limit


def migration_reason(exc: BaseException) -> str | None:
    """Why a worker failure may be migrated (the metric's label), or None if it may not: the
    worker vanished, or its typed error says the request may be tried elsewhere
    (shutting_down, overloaded, engine failure ...; turbine.protocol.errors.RETRYABLE)."""
    if isinstance(exc, PeerDisconnected):
        return DISCONNECTED
    if isinstance(exc, RemoteError) and exc.error.retryable and exc.code != codes.INVALID_REQUEST:
        return exc.code
    return None


def why_not_continued(request: GenerateRequest, generated: int, max_seq_len: int | None) -> str | None:
    """Why a request that has generated `generated` tokens (all choices) cannot continue on
    another worker, or None if it can."""
    if generated == 0:
        return None  # nothing was sent yet: the request starts over whole
    if request.structured_outputs is not None:
        return "structured outputs cannot continue mid-grammar on another worker"
    if request.sampling.n > 1:
        return "a request with n > 1 cannot continue on another worker once it has generated"
    if request.prompt_embeds is not None:
        return "a prompt given as embeddings cannot be extended with generated tokens"
    if request.text is not None:
        return "text mode has no prompt token ids to extend with generated tokens"
    if max_seq_len is not None and len(request.token_ids) + generated > max_seq_len:
        return f"prompt plus generated tokens exceed --migration-max-seq-len {max_seq_len}"
    return None


def continuation(original: GenerateRequest, generated: list[int], attempt: int) -> GenerateRequest:
    """The request that goes on from `generated` (the tokens of its one choice so far) on
    another worker. Its id is the original's plus the attempt number: a worker (or prefill
    worker) may still hold the first attempt under the original id."""
    stop = original.stop
    if generated:
        done = len(generated)
        stop = msgspec.structs.replace(
            stop, max_tokens=None if stop.max_tokens is None else stop.max_tokens - done,
            min_tokens=None if stop.min_tokens is None else max(stop.min_tokens - done, 0))
    output = original.output
    if generated and output.prompt_logprobs is not None:
        # The first chunk brought the prompt's logprobs already.
        output = msgspec.structs.replace(output, prompt_logprobs=None)
    return msgspec.structs.replace(
        original, request_id=f"{original.request_id}-m{attempt}",
        token_ids=[*original.token_ids, *generated] if generated else original.token_ids,
        stop=stop, output=output, kv_transfer_params=None, dp_rank=None)
