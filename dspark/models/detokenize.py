"""Incremental detokenization: a request's output text, O(new tokens) of work per token.

`Detokenizer.push(token_id)` returns the characters that token made final. It decodes only a
short window: a few already-shown ids for context (`recent`, so decoders that treat a leading
space or byte specially see what a full decode sees) and the ids since (`pending`), and shows
the window's new text except a trailing U+FFFD, the one character a later token may still
change (a multi-byte character split across tokens). A run of invalid bytes, which small and
random models emit, keeps a window ending in U+FFFD; once `pending` grows past `LIMIT` the
window start moves to an earlier boundary whose text the longer decode confirmed, so the
window stays short. (`tokenizers.decoders.DecodeStream` withholds everything after such a
byte and re-decodes its whole growing window per token: quadratic, and blind to stop strings
in that text.) Stop strings are searched in the new text plus the characters before it where
one could have begun.

The engine keeps one per request (stop strings, the final text); the server streams the
pieces it produced (`pieces`), so nothing decodes the whole output again per step. The pieces
plus `final()`'s tail equal `TextTokenizer.decode(all ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark.models.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"  # what a decoder shows for an invalid or incomplete UTF-8 sequence
CONTEXT = 4  # shown ids kept to decode the next ones in context
LIMIT = 8  # pending ids past which the window start moves (a UTF-8 character spans at most 4 bytes)


class Detokenizer:
    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.keep = max((len(s) for s in self.stop), default=1) - 1  # a stop string may begin this far back
        self.pieces: list[str] = []  # the text shown so far, in the pieces tokens made final
        self.length = 0  # characters in pieces
        self.tail = ""  # the last `keep` characters shown
        self.recent: list[int] = []  # the last CONTEXT ids before the window's new text
        self.before = ""  # their text
        self.pending: list[int] = []  # ids since then
        self.shown = 0  # characters of the pending ids' text already shown
        self.stop_at: int | None = None  # where the first stop string begins, once one appeared

    def push(self, token_id: int) -> str:
        """One more output token -> the characters now final ("" while none are)."""
        self.pending.append(token_id)
        text = self._in_context(self.pending)
        if text is None:  # a decoder that rewrites earlier text here: nothing final yet (final() decodes all)
            return ""
        done = len(text) - 1 if text.endswith(REPLACEMENT) else len(text)
        chunk = text[self.shown : done] if done > self.shown else ""
        self.shown = max(self.shown, done)
        if done == len(text):  # a clean end: the next window starts here
            self._advance(len(self.pending), len(text))
        elif len(self.pending) > LIMIT:
            self._shorten(text)
        if chunk:
            self._show(chunk)
        return chunk

    def _in_context(self, ids: list[int]) -> str | None:
        """The text `ids` add after the recent ids (what a full decode adds there), or None
        where decoding them together changes the recent ids' own text."""
        after = self.tokenizer.decode(self.recent + ids)
        return after[len(self.before) :] if after.startswith(self.before) else None

    def _advance(self, count: int, chars: int) -> None:
        """The first `count` pending ids (`chars` characters, all shown) become context."""
        self.recent = (self.recent + self.pending[:count])[-CONTEXT:]
        self.before = self.tokenizer.decode(self.recent)
        self.pending = self.pending[count:]
        self.shown -= chars

    def _shorten(self, text: str) -> None:
        """Move the window start past the earliest pending ids whose text the whole window's
        decode confirms (it starts with theirs), keeping the last CONTEXT pending ids."""
        for cut in range(len(self.pending) - CONTEXT, 0, -1):
            part = self._in_context(self.pending[:cut])
            if part is not None and len(part) <= self.shown and text.startswith(part):
                self._advance(cut, len(part))
                return

    def _show(self, chunk: str) -> None:
        if self.stop and self.stop_at is None:
            window = self.tail + chunk
            hits = [window.find(s) for s in self.stop if s in window]
            if hits:
                self.stop_at = self.length - len(self.tail) + min(hits)
            self.tail = window[-self.keep :] if self.keep else ""
        self.pieces.append(chunk)
        self.length += len(chunk)

    @property
    def text(self) -> str:
        """The characters shown so far (a join: read it at the end, not per token)."""
        return "".join(self.pieces)

    def final(self, ids: Sequence[int]) -> str:
        """The whole text of the output `ids` (all pushed), as a full decode gives it: a trailing
        incomplete character decodes to U+FFFD; cut before the first stop string, if any."""
        text = self.text
        if self.stop_at is not None:
            return text[: self.stop_at]
        rest = self._in_context(self.pending) if self.pending else ""
        return text + rest[self.shown :] if rest is not None else self.tokenizer.decode(list(ids))
