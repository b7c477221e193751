"""--reply-text: every simulated answer is a fixed text's tokens (then EOS)."""

from __future__ import annotations

from turbine.frontend.models.tokenizer import TextTokenizer
from turbine.mocker.args import parse_mocker_args
from turbine.mocker.tokens import Choice, TokenSampler
from turbine.mocker.worker import reply_token_ids

EOS = 999


def _answer(sampler: TokenSampler, choice: Choice, max_tokens: int) -> list[int]:
    n = sampler.answer_len(choice)
    out = []
    for p in range(max_tokens):
        out.append(sampler.token(choice, p, n))
        if out[-1] == EOS:
            break
    return out


def test_a_fixed_reply_then_eos_whatever_the_prompt():
    sampler = TokenSampler(1000, [EOS], [0], natural_output_len=128, reply_token_ids=[5, 6, 7])
    for seed in (1, 2, 3):
        assert _answer(sampler, Choice(seed, 0, 0, frozenset(), False), 50) == [5, 6, 7, EOS]
    assert _answer(sampler, Choice(1, 0, 0, frozenset(), True), 8) == [5, 6, 7, 5, 6, 7, 5, 6]  # ignore_eos


def test_reply_text_flag_gives_the_texts_tokens():
    cfg = parse_mocker_args(["--reply-text", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    ids = reply_token_ids(cfg)
    assert TextTokenizer.from_dir(cfg.tokenizer_path).decode(ids) == cfg.reply_text
    assert reply_token_ids(parse_mocker_args([])) == []
