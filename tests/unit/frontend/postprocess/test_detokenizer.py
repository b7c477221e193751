import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbine.frontend.postprocess.detokenizer import IncrementalDetokenizer

# Session-scoped fixtures are fine to share across hypothesis examples: they are read-only.
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

MULTIBYTE_TEXTS = [
    "Hello 👋🌍 世界 — café 🧑‍🚀",
    "日本語のテキストを分割する。한국어 텍스트도. Ελληνικά!",
    "🙂🙃🫠🥹 emoji only then ascii",
    "ç̃ combining marks a\u0301 e\u0301 and \U0001f468\u200d\U0001f469\u200d\U0001f467",
]


def stream(tokenizer, ids, chunks=(1,), prompt_ids=None, stop=(), **options):
    """Push `ids` in chunks of the given sizes (cycled); returns (pieces, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, list(stop), **options)
    pieces, start = [], 0
    for size in itertools.cycle(chunks):
        if start >= len(ids):
            break
        pieces.append(detok.push(ids[start:start + size]))
        start += size
    pieces.append(detok.flush())
    return pieces, detok


def cut_at_first_stop(text, stops, include):
    """Reference: scan the text a character at a time, as a non-streaming server would."""
    for end in range(1, len(text) + 1):
        # Among stop strings ending here, the longest one started first.
        for s in sorted((s for s in stops if s), key=len, reverse=True):
            if text[:end].endswith(s):
                return (text[:end] if include else text[:end - len(s)]), s
    return text, None


# --- UTF-8 safety -----------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [(1,), (2,), (3, 1), (1000,)])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_pieces_are_whole_characters(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The test is only meaningful if some tokens really split a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces, _ = stream(tokenizer, ids, chunks)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_emoji_is_emitted_once_complete(tokenizer):
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    pieces, _ = stream(tokenizer, ids)
    assert [p for p in pieces if p] == ["a", "🙂"]


@PROPERTY
@given(text=st.text(max_size=60), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5), with_prompt=st.booleans())
def test_streamed_text_equals_decoded_text(tokenizer, text, chunks, with_prompt):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}]) if with_prompt else None
    pieces, _ = stream(tokenizer, ids, chunks, prompt_ids=prompt)
    assert "".join(pieces) == tokenizer.decode(ids)


@PROPERTY
@given(ids=st.lists(st.integers(0, 49151), max_size=40), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       skip=st.booleans())
def test_any_token_sequence_streams_like_decode(tokenizer, ids, chunks, skip):
    # Arbitrary ids: special tokens, stray continuation bytes, never-completed characters.
    pieces, _ = stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_decode_window_stays_small(tokenizer, monkeypatch):
    ids = tokenizer.encode("Streaming 文字 and emoji 🎉 over many tokens. " * 100, add_special_tokens=False)
    longest = 0
    decode = tokenizer.decode

    def spy(window, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(window))
        return decode(window, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", spy)
    pieces, _ = stream(tokenizer, ids, prompt_ids=list(range(100, 400)))
    assert "".join(pieces) == decode(ids)
    assert len(ids) > 1000 and longest <= 10


# --- special tokens ---------------------------------------------------------------------

def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    skipped, _ = stream(tokenizer, ids)
    kept, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == "assistant\nHi there"
    assert "".join(kept) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_stop_string_made_of_a_special_token(tokenizer):
    ids = tokenizer.encode("Hi there<|im_end|>more", add_special_tokens=False)
    pieces, detok = stream(tokenizer, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(pieces) == "Hi there"
    assert detok.stop_reason == "<|im_end|>"


# --- stop strings -----------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [(1,), (2,), (1000,)])
def test_stop_string_spanning_tokens(tokenizer, chunks):
    ids = tokenizer.encode("hello world, and then more text", add_special_tokens=False)
    assert tokenizer.decode(ids[:1]) == "hello"  # "lo wor" straddles the first two tokens
    pieces, detok = stream(tokenizer, ids, chunks, stop=["lo wor"])
    assert "".join(pieces) == "hel"
    assert detok.stopped and detok.stop_reason == "lo wor"


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("hello world, and then more text", add_special_tokens=False)
    pieces, detok = stream(tokenizer, ids, stop=["lo wor"], include_stop_str_in_output=True)
    assert "".join(pieces) == "hello wor"
    assert detok.stop_reason == "lo wor"


def test_pushes_after_stop_return_nothing(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, None, ["lo wor"])
    assert detok.push(tokenizer.encode("hello world", add_special_tokens=False)) == "hel"
    assert detok.push(tokenizer.encode(" again", add_special_tokens=False)) == ""
    assert detok.flush() == ""


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, None, ["lo wor"])
    assert detok.push(tokenizer.encode("hello", add_special_tokens=False)) == "hel"  # "lo" may start "lo wor"
    assert detok.push(tokenizer.encode(" there", add_special_tokens=False)) == "lo there"
    assert not detok.stopped


def test_flush_releases_held_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, None, ["lo wor"])
    assert detok.push(tokenizer.encode("hello", add_special_tokens=False)) == "hel"
    assert detok.flush() == "lo"
    assert not detok.stopped and detok.stop_reason is None


def test_stop_completing_first_wins_whatever_the_chunking(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    for chunks in [(1,), (1000,)]:
        pieces, detok = stream(tokenizer, ids, chunks, stop=["hello world", "o w"])
        assert "".join(pieces) == "hell" and detok.stop_reason == "o w"


def test_empty_stop_string_is_ignored(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    pieces, detok = stream(tokenizer, ids, stop=[""])
    assert "".join(pieces) == "hello world" and not detok.stopped


@PROPERTY
@given(
    text=st.text(alphabet="helo wrd", max_size=40),
    stops=st.lists(st.text(alphabet="helo wrd", min_size=1, max_size=6), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    include=st.booleans(),
)
def test_stop_strings_streamed_equal_non_streamed(tokenizer, text, stops, chunks, include):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected, reason = cut_at_first_stop(tokenizer.decode(ids), stops, include)
    pieces, detok = stream(tokenizer, ids, chunks, stop=stops, include_stop_str_in_output=include)
    assert "".join(pieces) == expected
    assert detok.stop_reason == reason and detok.stopped == (reason is not None)


@PROPERTY
@given(text=st.text(alphabet="ab🙂é世 ", max_size=30), stop=st.text(alphabet="ab🙂é世 ", min_size=1, max_size=4),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_multibyte_stop_strings(tokenizer, text, stop, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected, reason = cut_at_first_stop(text, [stop], include=False)
    pieces, detok = stream(tokenizer, ids, chunks, stop=[stop])
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == expected and detok.stop_reason == reason


# --- the incremental decoder ------------------------------------------------------------

def test_decode_stream_does_the_per_token_work(tokenizer, monkeypatch):
    # One step of tokenizers' DecodeStream per push; no Python decode until the end.
    ids = tokenizer.encode("Streaming 文字 and emoji 🎉 over tokens.", add_special_tokens=False)
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or decode(*a, **k))
    detok = IncrementalDetokenizer(tokenizer, [100, 200, 300], [])
    calls.clear()  # (the prompt context is checked once)
    pieces = [detok.push([i]) for i in ids]
    assert calls == []
    pieces.append(detok.flush())
    assert "".join(pieces) == decode(ids)


@pytest.mark.parametrize("chunks", [(1,), (2,), (3, 1)])
def test_falls_back_to_python_window_when_the_stream_refuses(tokenizer, monkeypatch, chunks):
    # A decoder whose text does not only grow makes DecodeStream raise; the rest of the
    # stream is decoded by the Python window, from where the stream had got to.
    text = "Hello 👋🌍 世界 — café, with a stop somewhere here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    real = tokenizer.decode_stream

    def flaky(context, skip):
        step, n = real(context, skip), 0

        def wrapped(token_ids):
            nonlocal n
            n += 1
            if n == 4:
                raise Exception("Invalid prefix encountered")  # noqa: TRY002 - what tokenizers raises
            return step(token_ids)
        return wrapped

    monkeypatch.setattr(tokenizer, "decode_stream", flaky)
    pieces, _ = stream(tokenizer, ids, chunks, prompt_ids=tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    pieces, detok = stream(tokenizer, ids, chunks, stop=["somewhere"])
    assert "".join(pieces) == "Hello 👋🌍 世界 — café, with a stop " and detok.stop_reason == "somewhere"


def test_prompt_ending_inside_a_character_is_not_repeated(tokenizer):
    prompt = tokenizer.encode("say 🫠", add_special_tokens=False)[:-1]  # cut inside the emoji
    assert tokenizer.decode(prompt[-5:]).endswith("\ufffd")
    ids = tokenizer.encode(" fine", add_special_tokens=False)
    pieces, _ = stream(tokenizer, ids, prompt_ids=prompt)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 🫠", add_special_tokens=False)[:-1]
    pieces, _ = stream(tokenizer, ids)
    assert pieces[-1].endswith("\ufffd") and "".join(pieces) == tokenizer.decode(ids)
