"""The types that cross the frontend's stages: what preprocess tells postprocess (OutputSpec,
with its OutputParser chain), and what postprocess hands the format stage: per-choice deltas made
of structured parts (answer text, reasoning text, tool-call fragments, logprobs), and the usage count."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the prompt's first token (no context to predict it from)
    top: list[tuple[int, float]]


@dataclass(slots=True)
class ToolCallDelta:
    """A fragment of one tool call, in OpenAI's streaming shape: the call's index, then its id
    and name once, then pieces of its JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    index: int  # the choice
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def shown(self) -> bool:
        """Whether a client sees anything of it: a stream writes a chunk only for these."""
        return bool(self.text or self.finish_reason or self.logprobs or self.reasoning or self.tool_calls)

    def mergeable_with(self, later: Delta) -> bool:
        """Whether `later` may be appended to this one (plain text of one unfinished choice)."""
        return (self.index == later.index and self.finish_reason is None and not self.logprobs
                and not later.logprobs and not self.reasoning and not later.reasoning
                and self.tool_calls is None and later.tool_calls is None)


@dataclass(slots=True)
class UsageCount:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


class OutputParser(Protocol):
    """Turns one choice's deltas into structured parts (e.g. text into tool-call fragments).
    `push` may hold text back; `finish` releases what is held when the choice ends."""

    def push(self, delta: Delta) -> Delta: ...

    def finish(self, delta: Delta) -> Delta: ...


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How the postprocess stage turns token ids into text."""

    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    parsers: Callable[[], list[OutputParser]] = field(default=list)  # makes one choice's output-parser chain
