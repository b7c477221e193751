"""What the mocker needs to know about the model it pretends to run, read from its
Hugging Face folder: vocabulary, special and EOS tokens, context length, KV size per token."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from turbine.mocker.kv_transfer import kv_bytes_per_token


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    max_position_embeddings: int | None
    kv_bytes_per_token: int | None = None  # None: the config does not say
    word_token_ids: tuple[int, ...] = ()  # tokens that are one whole lowercase word after a space
    bos_token_id: int | None = None  # the model config's (the health check's default prompt)


# A space marker (byte-level BPE's "Ġ", SentencePiece's "▁") and a lowercase word: a run of
# such tokens decodes to plain words that the tokenizer encodes back to the same tokens.
_WORD_TOKEN = re.compile(r"[\u0120\u2581][a-z]{2,}")


def read_model_info(folder: str) -> ModelInfo:
    from tokenizers import Tokenizer

    root = Path(folder)
    config = _json(root / "config.json")
    # vLLM stops on the generation config's EOS ids when there are any, else the model's.
    eos = _json(root / "generation_config.json").get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if "vocab_size" in config:  # the embedding may be padded past the tokenizer: stay decodable
        vocab = min(vocab, config["vocab_size"])
    special = tuple(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)
    return ModelInfo(vocab_size=vocab, eos_token_ids=eos_ids, special_token_ids=special,
                     max_position_embeddings=config.get("max_position_embeddings"),
                     kv_bytes_per_token=kv_bytes_per_token(config),
                     bos_token_id=config.get("bos_token_id") if isinstance(config.get("bos_token_id"), int) else None,
                     word_token_ids=tuple(sorted(i for text, i in tokenizer.get_vocab().items()
                                                 if i < vocab and _WORD_TOKEN.fullmatch(text))))


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
