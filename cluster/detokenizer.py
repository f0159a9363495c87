"""Incremental detokenization and stop-string matching.

Decoding token by token is wrong for byte-level BPE: one character (an accented letter, an
emoji) can span several tokens, and decoding a prefix that ends inside it yields U+FFFD. So
`IncrementalDetokenizer` decodes a short window of recent tokens and only emits text once the
window decodes to something that does not end in U+FFFD (the prefix-offset / read-offset
technique of HF text-generation-inference and vLLM). With a `tokenizers.Tokenizer` behind it,
`tokenizers`' own `DecodeStream` keeps that window in Rust (one call a token, not two decodes).
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as left context for the first decode. Tokenizers that strip or add a space
# at the start of a decode (SentencePiece's Metaspace) need a preceding token to render the first
# output token as it reads mid-sentence; vLLM uses 5.
INITIAL_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _backend(tokenizer: Any) -> _Decoder:
    # A transformers fast tokenizer wraps a `tokenizers.Tokenizer`; use that directly so
    # transformers' clean_up_tokenization_spaces cannot rewrite text across window boundaries.
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, emitting only stable text.

    Invariant: `text` is a prefix of `decode(output_ids)` that ends on a complete character;
    once the output ends on a complete character it equals `decode(output_ids)` for byte-level
    tokenizers. Text already returned by `append` is never revised.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ):
        self._tokenizer = _backend(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        # Only the window [prefix_offset:] is ever decoded again, so older ids are dropped.
        self._token_ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the context window (already-emitted tokens)
        self._read_offset = len(self._token_ids)  # first token whose text is not yet emitted
        self._text = ""
        self._stream: DecodeStream | None = None
        if isinstance(self._tokenizer, Tokenizer):
            self._stream = DecodeStream(
                ids=self._token_ids, skip_special_tokens=skip_special_tokens
            )
            self._recent = list(self._token_ids)  # the stream's ids, for a fallback to windows
            self._pending = 0  # of them, the last ones whose text has not come out yet

    @property
    def text(self) -> str:
        """All stable output text so far."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one output token; return the newly stable text ("" while a character is open)."""
        if self._stream is not None:
            try:
                new_text = self._stream.step(self._tokenizer, token_id)
            except Exception:  # a window's text did not continue its prefix's text
                self._fall_back_to_windows()
            else:
                self._recent.append(token_id)
                if new_text is None:
                    self._pending += 1
                    return ""
                self._pending = 0
                if len(self._recent) > 256:
                    del self._recent[:-INITIAL_CONTEXT_TOKENS]
                self._text += new_text
                return new_text
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            # Incomplete UTF-8 sequence (or a skipped special token): wait for more tokens.
            return ""
        new_text = window_text[len(prefix_text) :]
        # Slide the window: the tokens just emitted become the next context.
        del self._token_ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text += new_text
        return new_text

    def _fall_back_to_windows(self) -> None:
        """The rest of this request decoded by the windows kept here, from the stream's state:
        a few emitted ids as context, then the ids whose text has not come out."""
        self._stream = None
        pending = self._pending
        self._token_ids = self._recent[-(pending + INITIAL_CONTEXT_TOKENS) :]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids) - pending


def find_stop_string(
    text: str, stop_strings: list[str], start_char: int = 0
) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in `text` beginning at or after `start_char`.

    Returns (char index where the stop string begins, the stop string), or None. On a tie the
    longer stop string wins (its match covers the shorter one's). Matching is on the decoded
    text, so a stop string spanning several tokens is found like any other.
    """
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        index = text.find(stop, start_char)
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
            best = (index, stop)
    return best


def stop_search_start(num_old_chars: int, stop_strings: list[str]) -> int:
    """Where to resume searching after text grew from `num_old_chars`: a new match must end
    in the new text, so it starts at most `len(stop) - 1` chars before it."""
    longest = max((len(s) for s in stop_strings), default=0)
    return max(0, num_old_chars - longest + 1)


def num_stop_holdback_chars(text: str, stop_strings: list[str]) -> int:
    """How many trailing chars of `text` a stream must hold back because they could be the
    start of a stop string: the longest proper prefix of any stop string that `text` ends with.
    """
    holdback = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), holdback, -1):
            if text.endswith(stop[:length]):
                holdback = length
                break
    return holdback
