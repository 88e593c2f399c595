"""Tokenizers: HF `tokenizer.json` (via `tokenizers`) with a jinja2 chat template, or a built-in byte-level one.

`load_tokenizer(model, spec)` picks the backend: synthetic presets get `ByteTokenizer` (ids 0-255 are bytes,
then BOS and EOS as the preset says); a checkpoint folder with `tokenizer.json` gets `HFTokenizer`; a folder
without one gets None (the engine then accepts token-id prompts only).
(Streams of ids become text in `core/detokenizer.py`.)

`apply_chat_template` returns text that already holds the template's special tokens (e.g. BOS): encode it
with `add_special_tokens=False`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from modelspec.spec import PRESETS, ModelSpec, resolve_model_path

Message = dict[str, Any]

BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or cannot do what was asked."""


class Tokenizer:
    """The interface the engine, stop checker and server use."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (some chat models have several)."""
        return [] if self.eos_token_id is None else [self.eos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def _template_vars(self) -> dict[str, Any]:
        return {}

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render chat messages to a prompt string with the model's template."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; send a plain prompt instead")
        return _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       **self._template_vars(), **kwargs)


def _raise(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


_ENV: ImmutableSandboxedEnvironment | None = None


def _render(template: str, **variables: Any) -> str:
    """Render a chat template the way HF does (trim_blocks, lstrip_blocks, raise_exception, tojson)."""
    global _ENV
    if _ENV is None:
        _ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                             extensions=["jinja2.ext.loopcontrols"])
        _ENV.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
        _ENV.globals["raise_exception"] = _raise
        _ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return _ENV.from_string(template).render(**variables)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template error: {e}") from None


class ByteTokenizer(Tokenizer):
    """Ids 0-255 are UTF-8 bytes; BOS and EOS come after (256 and 257 for the synthetic presets)."""

    def __init__(self, bos_token_id: int | None = 256, eos_token_id: int | None = 257,
                 chat_template: str = BYTE_CHAT_TEMPLATE):
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template = chat_template
        self._special = {i: n for i, n in ((bos_token_id, "<|bos|>"), (eos_token_id, "<|eos|>")) if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of `text`, with BOS first when `add_special_tokens`."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids; invalid UTF-8 becomes U+FFFD; ids past the bytes carry no text."""
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
            elif not skip_special_tokens and i in self._special:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(self._special[i])
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` through the `tokenizers` library, chat template from the folder's config."""

    def __init__(self, folder: str | Path, spec: ModelSpec | None = None):
        import tokenizers  # only checkpoints with a tokenizer.json need it (a bare GPU image may lack it)

        folder = Path(folder)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"{folder / 'tokenizer.json'}: cannot load ({e})") from None
        config = _read_json(folder / "tokenizer_config.json")
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token, spec.bos_token_id if spec else None)
        self.eos_token_id = self._id(self.eos_token, spec.eos_token_id if spec else None)
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        self._eos_ids = list(dict.fromkeys([i for i in [self.eos_token_id, *extra] if i is not None]))
        self.chat_template = _chat_template(folder, config)

    def _id(self, token: str | None, fallback: int | None) -> int | None:
        tid = self._tok.token_to_id(token) if token else None
        return tid if tid is not None else fallback

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str | None:
        """The vocabulary's piece (string form) of a token id, None for an id outside it."""
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The whole tokenizer as the `tokenizers` library's JSON (tokenizer.json)."""
        return self._tok.to_str()

    def _template_vars(self) -> dict[str, Any]:
        return {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja`, else tokenizer_config's `chat_template` (a string or a list of named ones)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def load_tokenizer(model: str | Path, spec: ModelSpec | None = None) -> Tokenizer | None:
    """The tokenizer for a preset name or checkpoint folder; None when the folder has no tokenizer.json."""
    name = str(model)
    if (spec is not None and spec.synthetic) or (name in PRESETS and PRESETS[name].synthetic):
        spec = spec or PRESETS[name]
        return ByteTokenizer(spec.bos_token_id, spec.eos_token_id)
    folder = Path(resolve_model_path(name)).expanduser()
    if folder.is_file():
        folder = folder.parent
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder, spec)
    return None


def load_tokenizer_override(path: str, spec: ModelSpec) -> Tokenizer:
    """vLLM's `--tokenizer`: the tokenizer.json in folder `path`, for `spec`'s model; ValueError, in one line, where
    it cannot apply (a synthetic model's byte tokenizer, no tokenizer.json, more ids than the model's vocabulary)."""
    if spec.synthetic:
        raise ValueError(f"--tokenizer cannot apply: {spec.name} is synthetic, with its own byte-level tokenizer")
    folder = Path(path).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    tok = HFTokenizer(folder, spec)
    if tok.vocab_size > spec.vocab_size:
        raise ValueError(f"--tokenizer {path}: {tok.vocab_size} tokens, more than {spec.name}'s vocabulary of "
                         f"{spec.vocab_size}")
    return tok
