"""Streaming detokenization: token ids in, text that is safe to send to the client out.

Two stages, both O(1)-ish per token:
  1. UTF-8 safety. Byte-level BPE tokens can end in the middle of a character, which decodes
     to U+FFFD. The `tokenizers` library's own `DecodeStream` decodes only a small window of
     recent tokens (the last emitted ones as left context, plus the new ones) and returns the
     difference once the window no longer ends in U+FFFD: one call into Rust per chunk of
     tokens. (Before, this loop ran in Python with two `decode` calls per chunk; the Python
     loop is still here as the fallback for a decoder whose output does not only grow.)
  2. Stop strings. A stop string can span tokens, so the tail of the text that could still
     grow into one is held back until it either completes (we stop) or cannot (we emit it).
Concatenating every `push()` and the final `flush()` gives the same text as decoding all
generated ids at once, cut at the first stop string: streamed equals non-streamed.
"""

from __future__ import annotations

from turbine.frontend.models.tokenizer import TextTokenizer

# Prompt tokens kept as left context: some decoders (SentencePiece "▁" spaces) render the
# first token of a text differently from the same token after others.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: list[int] | None,
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        # DecodeStream treats a context that ends inside a character as not seen at all (its
        # text would come out as new): such a prompt gets no context.
        if context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context = []
        self._step = tokenizer.decode_stream(context, skip_special_tokens)
        # What the stream holds, for flush() and the fallback: the ids of the last emitted text
        # (the context of what follows) and the ids pushed since, not yet emitted.
        self._context = context
        self._pending: list[int] = []
        # The Python fallback's window, once in use: ids[:read_offset] were emitted already and
        # ids[prefix_offset:read_offset] is the context their successors are decoded after.
        self._ids: list[int] | None = None
        self._prefix_offset = self._read_offset = 0
        self._stops = [s for s in stop if s]  # "" would match everywhere: it means no stop
        self._include_stop = include_stop_str_in_output
        self._held = ""  # decoded text that may be the start of a stop string
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, token_ids: list[int]) -> str:
        """Feed newly generated ids; returns the new text that is safe to emit (maybe "")."""
        if self.stopped or not token_ids:
            return ""
        if self._ids is None:
            try:
                text = self._step(token_ids)
            except Exception:  # noqa: BLE001 - the decoded text did not extend the emitted one
                self._ids = self._context + self._pending
                self._prefix_offset, self._read_offset = 0, len(self._context)
                self._ids.extend(token_ids)
                text = self._decode_complete_chars()
            else:
                if text is None:
                    self._pending.extend(token_ids)
                    return ""
                if self._pending:
                    self._pending.extend(token_ids)
                    self._context, self._pending = self._pending, []
                else:
                    self._context = list(token_ids)
        else:
            self._ids.extend(token_ids)
            text = self._decode_complete_chars()
        return self._cut_at_stop(text, final=False) if self._stops else text

    def flush(self) -> str:
        """End of stream: returns everything still held back, incomplete characters included."""
        if self.stopped:
            return ""
        if self._ids is None:
            self._ids, self._prefix_offset, self._read_offset = self._context + self._pending, 0, len(self._context)
            self._pending = []
        prefix_text, text = self._decode_window()
        self._ids, self._prefix_offset, self._read_offset = [], 0, 0
        return self._cut_at_stop(text[len(prefix_text):], final=True)

    # -- the Python window (fallback and flush) --------------------------------------------
    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        ids, start = self._ids, self._prefix_offset
        if self._read_offset == len(ids):
            return "", ""
        prefix_text = decode(ids[start:self._read_offset], skip_special_tokens=self._skip_special_tokens)
        text = decode(ids[start:], skip_special_tokens=self._skip_special_tokens)
        return prefix_text, text

    def _decode_complete_chars(self) -> str:
        prefix_text, text = self._decode_window()
        # Nothing new (e.g. a skipped special token), or a character still awaits its next bytes.
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        # The emitted tokens become the context of the next ones; older ids are dropped.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return text[len(prefix_text):]

    # -- stop strings ----------------------------------------------------------------------
    def _cut_at_stop(self, new_text: str, final: bool) -> str:
        if not self._stops:
            return new_text
        text = self._held + new_text
        # The stop string that completes first wins (what a char-by-char scan would see),
        # so the result does not depend on how tokens were chunked; ties go to the longer one.
        found = [(i + len(s), i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            end, start, stop = min(found, key=lambda f: (f[0], f[1]))
            self.stopped, self.stop_reason, self._held = True, stop, ""
            return text[:end] if self._include_stop else text[:start]
        keep = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that some stop string starts with."""
        longest = max(len(s) for s in self._stops) - 1
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
