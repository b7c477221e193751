"""Tokenization and chat templates for the frontend, without torch or transformers.

A Hugging Face model folder is read with the `tokenizers` library, and chat templates are
rendered by a sandboxed jinja2 environment configured the way transformers configures its
own, so prompts come out identical to `AutoTokenizer.apply_chat_template`, which is what
vLLM's OpenAI server feeds its engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# The named special tokens transformers exposes to templates as variables (`bos_token`, ...).
_SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


# Prompts up to this many characters are encoded on the event loop's thread. Handing one to a
# worker thread cost 30-100 % more CPU than encoding it (a 133-token chat prompt: 181-188 us
# encoded in place, 240-360 us through the executor; benchmarks/frontend/frontend_cpu_micro.py), while
# 2,048 characters (~500 tokens) hold the loop for well under a millisecond.
INLINE_ENCODE_CHARS = 2048


class TextTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str],
        chat_templates: dict[str, str],
        eos_token_ids: list[int],
        bos_token_id: int | None,
    ) -> None:
        self._tokenizer = tokenizer
        self._special_tokens = special_tokens
        # Compiled up front so a broken template fails at startup, not on the first request.
        self._templates = {name: _compile(name, src) for name, src in chat_templates.items()}
        # Whether the template renders assistant messages' tool_calls (else they go in as text).
        self.renders_tool_calls = any("tool_calls" in src for src in chat_templates.values())
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path, chat_template_path: str | Path | None = None) -> TextTokenizer:
        """Load from a Hugging Face model folder; `chat_template_path` overrides its template."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (a fast tokenizer file is required)")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))

        # Older folders keep special tokens in special_tokens_map.json; tokenizer_config wins.
        config = _read_json(folder / "tokenizer_config.json")
        declared = {**_read_json(folder / "special_tokens_map.json"), **config}
        special_tokens = {
            key: content for key in _SPECIAL_TOKEN_KEYS
            if (content := _token_content(declared.get(key))) is not None
        }

        generation = _read_json(folder / "generation_config.json")
        eos_ids = _int_list(generation.get("eos_token_id"))
        eos_id = tokenizer.token_to_id(special_tokens.get("eos_token", ""))
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        bos_id = tokenizer.token_to_id(special_tokens.get("bos_token", ""))
        if bos_id is None:
            bos_id = generation.get("bos_token_id")

        templates = _load_chat_templates(folder, config, chat_template_path)
        return cls(tokenizer, special_tokens, templates, eos_ids, bos_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text. `add_special_tokens` runs the tokenizer's post-processor
        (e.g. a BOS prefix); pass False for text that already carries its special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` in a worker thread, so that a long prompt does not stall the event loop
        (and the tokens of every other stream). `encode_batch` releases the GIL where
        `encode` does not, so the thread really runs beside the loop. A short prompt is
        encoded right here: the trip to the thread costs more CPU than encoding it."""
        if len(text) <= INLINE_ENCODE_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        batch = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens))
        return batch[0].ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids for a conversation, equal to transformers' `apply_chat_template(tokenize=True)`."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        # The template writes BOS and friends itself (`{{ bos_token }}`); letting the
        # post-processor add them again would double them.
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text. Extra kwargs become template variables and
        override the special-token variables, as in transformers. Raises ValueError for
        unsupported content or when the template fails."""
        if not messages:
            raise ValueError("a chat needs at least one message")
        template = self._template_for(tools)
        flat = [_flatten_text_content(message, i) for i, message in enumerate(messages)]
        variables = {**self._special_tokens, **kwargs}
        try:
            return template.render(
                messages=flat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:  # includes the template's own raise_exception(...)
            raise ValueError(f"chat template error: {e}") from e
        except Exception as e:  # e.g. the template does `str + list` on a message it did not expect
            raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True):
        """The `tokenizers` library's own incremental decoder, primed with `context_ids` (text
        already seen, never returned), and the function that feeds it: `step(ids)` returns the
        new complete text, or None while a character still awaits its next bytes (or nothing
        visible came). One call into Rust per step. `step` raises when the decoded text stops
        extending what it returned before (a decoder that rewrites earlier text)."""
        stream = DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tokenizer)

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry (e.g. byte-level "Ġhello"), None for an unknown id."""
        return self._tokenizer.id_to_token(token_id)

    def _template_for(self, tools: list[dict[str, Any]] | None) -> jinja2.Template:
        # Same choice as transformers when a folder carries several named templates.
        if not self._templates:
            raise ValueError("this model has no chat template and no template file was given")
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ValueError(f"this model has several chat templates and none is named 'default': {sorted(self._templates)}")


def _flatten_text_content(message: Any, index: int) -> dict[str, Any]:
    """OpenAI lets content be a list of parts; text-model templates expect one string."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{index}] must be an object with a 'role'")
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    with_images = False
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image" and len(part) == 1:  # an image's place (media.split_media): the template writes its token
            with_images = True
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f"messages[{index}]: content part of type {kind!r} is not supported; "
                "this model only accepts text parts ({'type': 'text', 'text': ...})"
            )
        texts.append(part["text"])
    if with_images:  # a vision-language model's template takes the parts, images in their places
        return message
    # Joined with newlines, as vLLM does for templates that take string content.
    return {**message, "content": "\n".join(texts)}


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}`, which some HF templates use to mark
    assistant turns for training masks; for serving only the enclosed text matters."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '), which would alter tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


def _compile(name: str, source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {name!r} is invalid: {e.message} (line {e.lineno})") from e


def _load_chat_templates(folder: Path, config: dict[str, Any], override: str | Path | None) -> dict[str, str]:
    """Named templates, by precedence: override file, chat_template.jinja, tokenizer_config."""
    if override is not None:
        return {"default": Path(override).read_text(encoding="utf-8")}
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
        templates.update({entry["name"]: entry["template"] for entry in raw})
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    return templates


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    # A token is saved either as its string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
