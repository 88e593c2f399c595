"""Incremental detokenization: the text of a growing list of token ids, decoding a few recent ids per id.

Contract: after `push(t1) ... push(tk)` the returned pieces joined equal `tokenizer.decode([t1, ..., tk])`
without its trailing U+FFFD (an incomplete UTF-8 character is held back until its rest arrives, and so are the
replacement characters of invalid bytes until text follows them); after `flush()` they equal the whole decode.
So the text only grows, and every call decodes a window of a few ids, never the whole output.

How (vLLM's prefix_offset / read_offset): the window holds the ids read last as context, then the unread ids.
Each push decodes the window and keeps what lies past the context's own decode (cached), so a tokenizer whose
decode depends on the left context (the leading space of BPE and SentencePiece pieces, dropped at the start
of a decode) gives the text of the full decode. Once that unread text ends in a whole character, the unread
ids become the context. Ids that decode to nothing, alone and in pairs (special tokens, which decode skips;
ids past a byte vocabulary), are dropped. An unread tail of more than MAX_UNREAD ids still ending in U+FFFD
is invalid bytes, not an unfinished character: it is read up to a cut KEEP ids back after which the decode
only appends, so garbage does not grow the window. Exact for tokenizers whose decode is local in this sense
(byte-level BPE, SentencePiece, the byte tokenizer), where every id that carries text carries a byte.
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Turns token ids, one at a time, into text pieces that never split a character."""

    MAX_UNREAD = 8  # unread ids that may wait for a character to complete before the tail is cut
    KEEP = 4  # ids left unread at a cut: more than an incomplete UTF-8 character (3 bytes) can span

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._window: list[int] = []  # context ids, then unread ids
        self._read = 0  # where the unread ids start in the window
        self._context = ""  # decode of the context ids alone
        self._unread = ""  # text of the unread ids: the window's decode past the context's
        self._invalid = 0  # U+FFFD already read at a cut, not yet returned; they come before the unread text
        self._returned = 0  # characters of (invalid U+FFFD + unread text) already returned
        self._empty: dict[int, bool] = {}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _is_empty(self, token_id: int) -> bool:
        """Whether the id never carries text (a special token, an id past the vocabulary)."""
        empty = self._empty.get(token_id)
        if empty is None:
            empty = self._empty[token_id] = self._decode([token_id]) == "" == self._decode([token_id, token_id])
        return empty

    def _pending(self, start: int) -> str:
        """(invalid U+FFFD + unread text)[start:]."""
        if start >= self._invalid:
            return self._unread[start - self._invalid :]
        return REPLACEMENT_CHAR * (self._invalid - start) + self._unread

    def _read_up_to(self, cut: int, start: int) -> None:
        """The window's ids before `cut` become read; those from `start` to `cut` are the next context."""
        self._window = self._window[start:]
        self._read = cut - start
        self._context = self._decode(self._window[: self._read])

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now complete (often empty while a character is unfinished)."""
        token_id = int(token_id)
        if self._is_empty(token_id):
            return ""
        self._window.append(token_id)
        whole = self._decode(self._window)
        self._unread = whole[len(self._context) :]
        if self._unread and not self._unread.endswith(REPLACEMENT_CHAR):  # whole characters: read them all
            delta = self._pending(self._returned)
            self._read_up_to(len(self._window), self._read)
            self._unread, self._invalid, self._returned = "", 0, 0
            return delta
        visible = self._unread.rstrip(REPLACEMENT_CHAR)
        delta = ""
        if visible and self._invalid + len(visible) > self._returned:
            delta = self._pending(self._returned)[: self._invalid + len(visible) - self._returned]
            self._returned = self._invalid + len(visible)
        if len(self._window) - self._read > self.MAX_UNREAD:
            self._cut(whole)
        return delta

    def _cut(self, whole: str) -> None:
        """Read the older unread ids up to the latest cut, KEEP or more ids back, after which the decode only
        appends (the window's decode starts with the decode up to the cut and goes on past it)."""
        last = len(self._window) - self.KEEP
        for cut in range(last, max(self._read, last - self.KEEP), -1):
            head = self._decode(self._window[:cut])
            if len(self._context) <= len(head) < len(whole) and whole.startswith(head):
                read = self._invalid + len(head) - len(self._context)  # characters of pending text now read
                self._invalid, self._returned = max(0, read - self._returned), max(0, self._returned - read)
                self._unread = whole[len(head) :]
                # Context: the ids that may hold the start of a character still open at the cut.
                self._read_up_to(cut, max(self._read, cut - self.KEEP + 1))
                return

    def flush(self) -> str:
        """The held-back rest at the end of the stream (U+FFFD for an unfinished character)."""
        delta = self._pending(self._returned)
        self._read_up_to(len(self._window), self._read)
        self._unread, self._invalid, self._returned = "", 0, 0
        return delta
