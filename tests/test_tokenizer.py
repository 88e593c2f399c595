"""Byte-level and HF tokenizers, chat templates, and streaming detokenization."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.detokenizer import Detokenizer
from jaxserve.core.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
)
from modelspec.spec import PRESETS

TEXT = "héllo wörld, naïve café ✓ 日本語 🤖!"


def stream(tok, ids):
    detok = Detokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_byte_round_trip_and_specials():
    tok = load_tokenizer("tiny", PRESETS["tiny"])
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257) == (PRESETS["tiny"].bos_token_id,
                                                                  PRESETS["tiny"].eos_token_id)
    ids = tok.encode(TEXT)
    assert ids[0] == 256 and all(0 <= i < 256 for i in ids[1:])
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids + [257]) == TEXT
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    assert tok.decode([104, 300, 105]) == "hi"  # ids past the bytes (unused vocab) carry no text


def test_byte_streaming_never_splits_characters():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas = stream(tok, ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # held back inside multi-byte characters
    assert "🤖" in deltas


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=40))
def test_byte_streaming_property(text):
    tok = ByteTokenizer()
    assert "".join(stream(tok, tok.encode(text, add_special_tokens=False))) == text


def test_invalid_bytes_are_flushed():
    tok = ByteTokenizer()
    deltas = stream(tok, [104, 0xE6, 0x97])  # "h" then a truncated 3-byte character
    assert deltas[0] == "h" and "".join(deltas) == "h\ufffd"


def test_byte_chat_template():
    tok = ByteTokenizer()
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert not tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                       add_generation_prompt=False).endswith("<|assistant|>\n")


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
            "{{ raise_exception('bad role') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A small BPE tokenizer.json trained with the tokenizers library, a config with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, "hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    return folder


def test_hf_tokenizer_loading(hf_folder):
    tok = load_tokenizer(str(hf_folder), None)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, [1, 7])
    ids = tok.encode(TEXT)
    assert ids[0] == 0 and tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
    deltas = stream(tok, ids[1:])
    assert "".join(deltas) == TEXT and all("\ufffd" not in d for d in deltas)


def test_hf_chat_template(hf_folder):
    tok = load_tokenizer(hf_folder)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert tok.apply_chat_template(msgs) == "<s>[user] Hi</s>[assistant] Yo</s>[assistant] "
    with pytest.raises(TokenizerError, match="bad role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_file_and_missing_tokenizer(tmp_path, hf_folder):
    (tmp_path / "tokenizer.json").write_text((hf_folder / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "a|"
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "a"}])
    empty = tmp_path / "no_tok"
    empty.mkdir()
    assert load_tokenizer(empty) is None


def test_vllms_tokenizer_flag_takes_a_folder_or_says_why_not(tmp_path) -> None:
    from jaxserve.core.tokenizer import load_tokenizer_override
    from modelspec.spec import PRESETS, load_model_spec, resolve_model_path

    bard = load_model_spec("bard")
    tok = load_tokenizer_override(resolve_model_path("bard"), bard)
    assert tok.decode(tok.encode("ROMEO:", add_special_tokens=False)) == "ROMEO:"
    with pytest.raises(ValueError, match="tiny is synthetic"):
        load_tokenizer_override(resolve_model_path("bard"), PRESETS["tiny"])
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        load_tokenizer_override(str(tmp_path), bard)
