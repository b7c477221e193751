"""What the postprocess stage hands the format stage: per-choice deltas made of structured
parts (answer text, reasoning text, tool-call fragments, logprobs), and the usage count."""

from __future__ import annotations

from dataclasses import dataclass, field


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
