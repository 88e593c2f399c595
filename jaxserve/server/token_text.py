"""What clients see of tokens: for logprobs a token's text, its exact bytes and a key that no other token of a
list shares; for `/tokenizer_info` the tokenizer's special tokens and chat template.

A token that is part of a UTF-8 character (a byte token) decodes to U+FFFD on its own, so its decoded text
would lose its bytes and collide with every other such token. Its bytes come from the tokenizer's pieces
(`<0xNN>` pieces of SentencePiece vocabularies, the byte-to-unicode alphabet of byte-level BPE, or the id
itself for the byte tokenizer), and its text is then OpenAI's `bytes:\\xNN` form.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from jaxserve.core.tokenizer import ByteTokenizer, HFTokenizer
from jaxserve.server.responses import TokenizerInfo

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token text and bytes for one tokenizer (None: a model without one, whose tokens are `token_id:N`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _raw_bytes(self, tid: int) -> bytes | None:
        """The token's bytes from its piece, or None when the tokenizer cannot say."""
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            return bytes([tid]) if 0 <= tid < 256 else None
        if isinstance(tok, HFTokenizer):
            piece = tok.piece(tid)
            if piece is None:
                return None
            m = _BYTE_PIECE.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return None

    def text_and_bytes(self, tid: int) -> tuple[str, list[int] | None]:
        """The token as logprobs show it and its exact UTF-8 bytes (None without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{tid}", None
        text = self.tokenizer.decode([tid], skip_special_tokens=False)
        if not text:  # a token with no text of its own (an unused id) is shown by its id
            return f"token_id:{tid}", []
        if REPLACEMENT not in text:
            return text, list(text.encode("utf-8"))
        raw = self._raw_bytes(tid)
        if raw is None or raw.decode("utf-8", errors="replace") != text:  # not a piece of bytes we can read
            return text, list(text.encode("utf-8"))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: OpenAI's form, distinct for distinct bytes
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
        return text, list(raw)  # the token is U+FFFD itself

    def keys(self, tids: list[int]) -> list[str]:
        """Distinct keys for `tids` (a top-logprobs dict): each token's text, `token_id:N` for a repeat."""
        seen: set[str] = set()
        out = []
        for tid in tids:
            key = self.text_and_bytes(tid)[0]
            if key in seen:
                key = f"token_id:{tid}"
            seen.add(key)
            out.append(key)
        return out


def tokenizer_info(tok: Any, max_model_len: int, vocab_size: int) -> TokenizerInfo:
    """What lm-eval's RemoteTokenizer reads (vLLM's `/tokenizer_info`): special tokens as text, ids, template."""
    def text(tid: int | None, given: str | None) -> str | None:
        if given is not None or tid is None:
            return given
        return tok.decode([tid], skip_special_tokens=False) or None

    bos_id, eos_id = getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)
    return TokenizerInfo(tokenizer_class=type(tok).__name__, bos_token=text(bos_id, getattr(tok, "bos_token", None)),
                         eos_token=text(eos_id, getattr(tok, "eos_token", None)), pad_token=None, bos_token_id=bos_id,
                         eos_token_id=eos_id, chat_template=getattr(tok, "chat_template", None),
                         model_max_length=max_model_len, vocab_size=vocab_size)
