"""Incremental detokenization with stop strings, for streaming.

Decoding: vLLM's prefix_offset / read_offset scheme. Each update decodes only a short window of ids,
`ids[prefix_offset:]`, and compares it with the decode of `ids[prefix_offset:read_offset]` (cached): what
the new ids add to the window is the new text. The window starts with the last few prompt ids so that
the first output token is decoded in context. While the window's decode ends in U+FFFD, a multi-byte
character is still incomplete (byte-level BPE often splits a CJK character or an emoji across tokens):
the offsets do not move and no text is released until a later token completes it. The cost per update is
O(new ids + window), independent of how long the output already is.

Stop strings: only the newly decoded text plus the (longest stop - 1) characters before it are searched,
so a stop spanning several tokens is found once, when its last character arrives. Among the stops found in
one update the one that completes first in the text wins (ties: the longer one), which is what a character-
by-character stream would have done. On a match `output_text` is cut at the stop's start (or its end with
`include_stop_str_in_output`). While streaming, `get_delta` holds back the last (longest stop - 1)
characters (none when stop strings are included in the output), so released text never turns out to be
part of a stop string.

`spaces_between_special_tokens` is not applied: the fast tokenizer's decoder joins tokens itself.

Deferred decoding (`defer=True`, no stop strings): `update` only collects ids, and the text is decoded when
it is first read, in one pass through the same window scheme, so it is the text the per-update decodes
would have built. For outputs read once, at the end (`generate`'s FINAL_ONLY outputs), this takes the two
decodes per request per step out of the engine's loop: a host cost that grows with the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt ids decoded before the first output id, as context (vLLM uses 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


def _make_decode(tokenizer: Any, skip_special_tokens: bool):
    """ids -> text. Prefer the Rust tokenizer's decode (no Python per id); else the HF tokenizer's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch") and hasattr(tokenizer, "id_to_token"):
        backend = tokenizer  # a bare tokenizers.Tokenizer
    if backend is not None:
        # A partial, not a lambda: no Python frame for the two decodes per request per step.
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Detokenize one sequence's output ids as they arrive, detect stop strings, release text safely.

    `update(new_token_ids)` returns the stop string that matched (or None); the text so far is
    `output_text`; `get_delta()` returns what is safe to stream since the last call; `flush()` (at the end
    of the sequence, no stop matched) releases everything held back.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        *,
        min_tokens: int = 0,
        defer: bool = False,
    ) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self.stop: list[str] = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        max_stop = max((len(s) for s in self.stop), default=0)
        self._stop_search_back = max(max_stop - 1, 0)
        self._stop_buffer = 0 if include_stop_str_in_output else self._stop_search_back

        # Decode window: prompt tail as context, then the output ids.
        ctx = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text = self._decode(ctx) if ctx else ""

        self.output_token_ids: list[int] = []
        self._text = ""
        self._deferred = defer and not self.stop  # a stop string must be searched for as ids arrive
        self._behind = False  # deferred ids not decoded yet
        self.stop_reason: str | None = None
        self.finished = False
        self._released = 0  # chars of output_text handed out by get_delta

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def output_text(self) -> str:
        """The text so far (with deferred decoding: decoded now, if ids came since the last read)."""
        self._catch_up()
        return self._text

    @output_text.setter
    def output_text(self, text: str) -> None:
        self._text = text

    def _catch_up(self) -> None:
        if self._behind:
            self._behind = False
            self._text += self._decode_step()

    def update(self, new_token_ids: Iterable[int], stop_terminated: bool = False) -> str | None:
        """Add generated ids; return the stop string that matched, else None.

        `stop_terminated`: the last id is a stop token id (EOS or `stop_token_ids`) that ended the
        sequence; as in vLLM its text is not added unless `include_stop_str_in_output`.
        After a stop matched (or after `flush`) further ids are ignored.
        """
        if self.finished:
            return None
        new_ids = list(new_token_ids)
        if not new_ids:
            return None
        self.output_token_ids.extend(new_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_ids = new_ids[:-1]
            if not new_ids:
                return None
        self._ids.extend(new_ids)
        if self._deferred:
            self._behind = True
            return None

        new_text = self._decode_step()
        if not new_text:
            return None
        start = len(self._text)
        self._text += new_text

        if self.stop and len(self.output_token_ids) > self.min_tokens:
            return self._check_stop(start)
        return None

    def _decode_step(self) -> str:
        ids = self._ids
        text = self._decode(ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            # Nothing new yet, or an incomplete multi-byte character at the end: wait for more ids.
            return ""
        new_text = text[len(self._prefix_text) :]
        # Slide the window: the ids read so far become the next update's context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 0:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(ids[: self._read_offset])
        return new_text

    def _check_stop(self, new_start: int) -> str | None:
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            idx = text.find(s, max(new_start - len(s) + 1, 0))
            if idx < 0:
                continue
            key = (idx + len(s), idx, s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, idx, s = best
        self.output_text = text[: end if self.include_stop_str_in_output else idx]
        self._released = min(self._released, len(self.output_text))
        self.stop_reason = s
        self.finished = True
        return s

    def get_delta(self) -> str:
        """Text released since the last call (never part of a possible stop string, never a broken char)."""
        end = len(self.output_text)
        if not self.finished:
            end -= self._stop_buffer
        if end <= self._released:
            return ""
        delta = self.output_text[self._released : end]
        self._released = end
        return delta

    def flush(self) -> str:
        """End of sequence without a stop string: release the held-back characters and any incomplete
        tail (decoded as is, with U+FFFD for bytes that never formed a character). Returns the last
        delta; `output_text` is final afterwards."""
        if not self.finished:
            self._catch_up()
            text = self._decode(self._ids[self._prefix_offset :])
            if len(text) > len(self._prefix_text):
                self.output_text += text[len(self._prefix_text) :]
            self.finished = True
        return self.get_delta()
