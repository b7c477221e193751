import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from turbine.frontend.models.tokenizer import TextTokenizer

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "with_system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats."},
    ],
    "unicode": [{"role": "user", "content": "Traduis « bonjour » en 日本語 🙂\n  indented\ttab"}],
    "special_token_text": [{"role": "user", "content": "say <|im_end|> literally"}],
}


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make_model_dir(tmp_path: Path, source: Path, *, tokenizer_config: dict | None = None,
                   chat_template: str | None = None, generation_config: dict | None = None,
                   tokenizer_json: dict | None = None) -> Path:
    """A model folder sharing the real tokenizer, with chosen config files."""
    folder = tmp_path / "model"
    folder.mkdir()
    if tokenizer_json is None:
        (folder / "tokenizer.json").symlink_to(source / "tokenizer.json")
    else:
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    if tokenizer_config is None:
        tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def base_config(model_dir: Path, **extra) -> dict:
    return {**json.loads((model_dir / "tokenizer_config.json").read_text()), **extra}


# --- chat template parity with transformers ---------------------------------------------

@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_text_matches_transformers(tokenizer, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_ids_match_transformers(tokenizer, hf, name):
    messages = CONVERSATIONS[name]
    theirs = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tokenizer.encode_chat(messages) == theirs


def test_smollm_bos_comes_from_the_template_only(tokenizer):
    # SmolLM2's "BOS" is <|im_start|>, which the template writes; the post-processor adds nothing.
    ids = tokenizer.encode_chat(CONVERSATIONS["with_system"])
    assert ids[0] == tokenizer.bos_token_id == 1
    assert ids[1] != 1
    text = tokenizer.apply_chat_template(CONVERSATIONS["with_system"])
    assert tokenizer.encode(text, add_special_tokens=True) == ids


def test_bos_not_doubled_when_post_processor_adds_one(tmp_path, model_dir):
    # A Llama-style setup: the post-processor prefixes BOS and the template writes {{ bos_token }}.
    from transformers import AutoTokenizer

    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}},
    }
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    folder = make_model_dir(tmp_path, model_dir, chat_template=template, tokenizer_json=tokenizer_json)
    ours = TextTokenizer.from_dir(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS["multi_turn"]

    assert ours.encode("hi") == hf.encode("hi") == [1, 6004]  # plain text does get BOS
    ids = ours.encode_chat(messages)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids[:2] == [1, ids[1]] and ids[1] != 1


def test_list_content_is_flattened_to_text(tokenizer, hf):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    as_string = [{"role": "user", "content": "Hello\nworld"}]
    ours = tokenizer.apply_chat_template(parts)
    assert ours == tokenizer.apply_chat_template(as_string)
    assert ours == hf.apply_chat_template(as_string, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode_chat(parts) == hf.apply_chat_template(
        as_string, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert parts[0]["content"][0] == {"type": "text", "text": "Hello"}  # input left untouched


def test_non_text_part_is_rejected(tokenizer):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]}]
    with pytest.raises(ValueError, match=r"messages\[0\].*'image_url'.*only accepts text"):
        tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}], ["just a string"]])
def test_malformed_messages_are_rejected(tokenizer, messages):
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template(messages)


# --- plain tokenization -----------------------------------------------------------------

@pytest.mark.parametrize("text", ["hello world", "  leading spaces", "日本語と emoji 🧑‍🚀", "<|im_start|>user\nhi", ""])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(tokenizer, hf, text, add_special_tokens):
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    assert asyncio.run(tokenizer.encode_off_loop(text, add_special_tokens=add_special_tokens)) == ids
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_off_loop_short_inline_long_in_a_thread(tokenizer, add_special_tokens, monkeypatch):
    import threading

    from turbine.frontend.models import tokenizer as module

    short = "hello world 🧑‍🚀 " * 10
    long = "a long prompt 日本語 " * (module.INLINE_ENCODE_CHARS // 10)
    assert len(short) <= module.INLINE_ENCODE_CHARS < len(long)
    threads = []
    real = tokenizer._tokenizer

    class Spy:
        def __getattr__(self, name):
            attr = getattr(real, name)
            if name in ("encode", "encode_batch"):
                def called(*args, **kwargs):
                    threads.append((name, threading.current_thread() is threading.main_thread()))
                    return attr(*args, **kwargs)
                return called
            return attr

    monkeypatch.setattr(tokenizer, "_tokenizer", Spy())
    for text in (short, long):
        got = asyncio.run(tokenizer.encode_off_loop(text, add_special_tokens=add_special_tokens))
        assert got == real.encode(text, add_special_tokens=add_special_tokens).ids
    assert threads == [("encode", True), ("encode_batch", False)]


def test_token_metadata(tokenizer, hf):
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == len(hf) == 49152
    assert tokenizer.id_to_token(1) == "<|im_start|>"
    assert tokenizer.id_to_token(28120) == "hello"
    assert tokenizer.id_to_token(905) == "Ġworld"  # raw byte-level entry, not decoded text
    assert tokenizer.id_to_token(10**9) is None
    ids = [1, 28120, 905, 2]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hello world<|im_end|>"


def test_eos_ids_merge_generation_config_list_and_tokenizer_eos(tmp_path, model_dir):
    folder = make_model_dir(tmp_path, model_dir, generation_config={"eos_token_id": [0, 2]},
                            tokenizer_config=base_config(model_dir, eos_token={"content": "<file_sep>"}))
    tok = TextTokenizer.from_dir(folder)
    assert tok.eos_token_ids == [0, 2, 5]


# --- where the template comes from --------------------------------------------------------

def test_template_from_tokenizer_config_string(tmp_path, model_dir, tokenizer):
    template = (model_dir / "chat_template.jinja").read_text()
    folder = make_model_dir(tmp_path, model_dir, tokenizer_config=base_config(model_dir, chat_template=template))
    messages = CONVERSATIONS["multi_turn"]
    assert TextTokenizer.from_dir(folder).apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_named_templates_pick_tool_use_when_tools_given(tmp_path, model_dir):
    named = [
        {"name": "default", "template": "plain:{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "tools:{{ tools | map(attribute='function.name') | join(',') }}"},
    ]
    folder = make_model_dir(tmp_path, model_dir, tokenizer_config=base_config(model_dir, chat_template=named))
    tok = TextTokenizer.from_dir(folder)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert tok.apply_chat_template(messages) == "plain:hi"
    assert tok.apply_chat_template(messages, tools=tools) == "tools:get_weather"


def test_custom_template_file_overrides_the_model(tmp_path, model_dir):
    custom = tmp_path / "custom.jinja"
    custom.write_text("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    tok = TextTokenizer.from_dir(model_dir, chat_template_path=custom)
    assert tok.apply_chat_template(CONVERSATIONS["with_system"]) == (
        "[SYSTEM] You answer in one word.\n[USER] Capital of France?\n[ASSISTANT]")


def test_missing_template_fails_only_when_used(tmp_path, model_dir):
    tok = TextTokenizer.from_dir(make_model_dir(tmp_path, model_dir))  # completions still work
    assert tok.encode("hi") == [6004]
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS["user_only"])


# --- the jinja environment ------------------------------------------------------------

def override(tmp_path: Path, model_dir: Path, template: str) -> TextTokenizer:
    path = tmp_path / "t.jinja"
    path.write_text(template)
    return TextTokenizer.from_dir(model_dir, chat_template_path=path)


def test_environment_matches_hugging_face(tmp_path, model_dir, hf):
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}\n"
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "    {% generation %}{{ m.content }}{% endgeneration %}\n"
        "{% endfor %}\n"
        "{{ tools | tojson }}|{{ {'b': 1, 'a': [2]} | tojson(indent=1, sort_keys=True) }}|{{ strftime_now('%Y') }}"
    )
    tok = override(tmp_path, model_dir, template)
    tools = [{"description": "<b>bold</b> & 'quoted' é"}]
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    text = tok.apply_chat_template(messages, tools=tools)
    assert text == hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                          add_generation_prompt=True)
    assert text.startswith("<|im_start|>|<|im_end|>|<|im_end|>|<|endoftext|>\none[")
    assert '"<b>bold</b> & \'quoted\' é"' in text  # tojson neither HTML-escapes nor ASCII-escapes


def test_kwargs_become_template_variables(tmp_path, model_dir):
    tok = override(tmp_path, model_dir, "{{ bos_token }} {{ enable_thinking }}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False, bos_token="<s>") == "<s> False"


def test_raise_exception_surfaces_as_value_error(tmp_path, model_dir):
    tok = override(tmp_path, model_dir, "{% if messages[0].role != 'user' %}{{ raise_exception('Roles must start with user') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="Roles must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_runtime_error_is_value_error(tokenizer):
    # SmolLM2's template concatenates role + content, so a non-string content breaks it.
    with pytest.raises(ValueError, match="chat template failed"):
        tokenizer.apply_chat_template([{"role": "user", "content": None}])


def test_invalid_template_fails_at_load(tmp_path, model_dir):
    with pytest.raises(ValueError, match="invalid"):
        override(tmp_path, model_dir, "{% for m in messages %}never closed")


def test_sandbox_blocks_unsafe_access(tmp_path, model_dir):
    tok = override(tmp_path, model_dir, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_frontend_modules_do_not_import_heavy_libraries():
    code = (
        "import sys, turbine.frontend.models.tokenizer, turbine.frontend.postprocess.detokenizer\n"
        "heavy = sorted({'torch', 'transformers', 'vllm'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
