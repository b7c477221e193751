"""Feeds recorded model outputs to a parser chain as the postprocess stage does, split in every
way the tests ask for, and reassembles what came out the way an OpenAI client would."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from turbine.frontend.deltas import Delta

Chain = Callable[[], list]  # makes one choice's parsers
_ID = re.compile(r"call_[0-9a-f]{24}")


@dataclass
class Result:
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON text)
    finish_reason: str | None = None


def run(chain: Chain, chunks: list[str], finish_reason: str = "stop", separate_finish: bool = False) -> Result:
    """Each chunk becomes a Delta; the last carries the finish reason (or, with
    `separate_finish`, an empty delta after them does). Checks the deltas' shape on the way."""
    parsers = chain()
    deltas = [Delta(0, c) for c in chunks]
    if separate_finish or not deltas:
        deltas.append(Delta(0, ""))
    deltas[-1].finish_reason = finish_reason
    out = []
    for delta in deltas:
        for p in parsers:  # as Postprocess.apply runs its chain
            delta = p.push(delta)
            if delta.finish_reason is not None:
                delta = p.finish(delta)
        out.append(delta)
    return assemble(out)


def assemble(deltas: list[Delta]) -> Result:
    """Joins the deltas as a client does, checking OpenAI's streaming shape: a call's first
    fragment has its index (the next one), a fresh id and its name; later ones neither."""
    r, ids = Result(), []
    for i, d in enumerate(deltas):
        assert d.index == 0
        assert (d.finish_reason is not None) == (i == len(deltas) - 1), "only the last delta finishes"
        r.content += d.text
        r.reasoning += d.reasoning
        for f in d.tool_calls or ():
            if f.index == len(r.calls):
                assert f.id is not None and _ID.fullmatch(f.id) and f.id not in ids, f.id
                assert f.name, "a call's first fragment names it"
                ids.append(f.id)
                r.calls.append((f.name, ""))
            else:
                assert f.index == len(r.calls) - 1, "fragments of one call at a time, in order"
                assert f.id is None and f.name is None, "id and name go out once"
            name, args = r.calls[f.index]
            r.calls[f.index] = (name, args + f.arguments)
    r.finish_reason = deltas[-1].finish_reason
    return r


def check(chain: Chain, text: str, expected: Result, finish_reason: str = "stop") -> None:
    """The one-shot result equals `expected`, and the same text streamed, split at every
    position (and, for short texts, a character at a time, and in random pieces), gives
    the same result."""
    one = run(chain, [text], finish_reason)
    assert one == expected
    for name, args in one.calls:  # arguments are JSON that a client can load
        json.loads(args)
    assert run(chain, [text], finish_reason, separate_finish=True) == one
    for i in range(len(text) + 1):
        assert run(chain, [text[:i], text[i:]], finish_reason) == one, f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    if len(text) <= 600:
        assert run(chain, list(text), finish_reason) == one, "a character at a time"
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(chain, pieces, finish_reason, separate_finish=rng.random() < 0.5) == one, pieces


def calls(*pairs: tuple[str, dict]) -> list[tuple[str, str]]:
    """Expected calls; their arguments text is the compact-spaced JSON every parser emits."""
    return [(name, json.dumps(args, ensure_ascii=False)) for name, args in pairs]


def case(text: str, content: str = "", *expected_calls: tuple[str, dict], reasoning: str = "",
         finish: str = "stop", id: str):
    """A recorded output and what it must give; the model stopped with `finish` (a model that
    stopped by itself after calling tools finishes with "tool_calls")."""
    reason = "tool_calls" if expected_calls and finish == "stop" else finish
    return pytest.param(text, Result(content, reasoning, calls(*expected_calls), reason), finish, id=id)


def params(cases: dict[str, list]) -> list:
    """{parser name: [case, ...]} -> parameters (name, text, expected, finish)."""
    return [pytest.param(name, *p.values, id=f"{name}-{p.id}") for name, ps in cases.items() for p in ps]
