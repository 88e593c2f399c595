"""StopChecker and its incremental Detokenizer: stop strings, hold-back rules, and cost linear in output length.

Each example feeds a request's output tokens one at a time, as the engine does, and looks at `stops.text`
after every token: the text only grows, never shows half a character or the start of a possible stop string,
and always equals what a full `tokenizer.decode` of the output would give under those rules.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core.detokenizer import Detokenizer
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.stops import StopChecker
from jaxserve.core.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BYTES = ByteTokenizer()  # ids 0-255 are bytes, 256 BOS, 257 EOS
EOS = BYTES.eos_token_id
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
CORPUS = ["héllo wörld, naïve café ✓ 日本語 🤖!", "the quick brown fox jumps over the lazy dog", "STOP </answer>"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    """A small byte-level BPE trained here on a tiny in-memory corpus, loaded the way the engine loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    loaded = load_tokenizer(folder)
    assert isinstance(loaded, HFTokenizer) and loaded.eos_token_id == 1
    return loaded


def generate(tokenizer, ids: list[int], max_tokens: int | None = None, history: bool = True,
             **params) -> tuple[list[str], tuple | None]:
    """Feed `ids` as drawn tokens; return the text after each token (only the last one unless `history`) and
    the finish (status, reason), if any."""
    p = SamplingParams(max_tokens=None, **params)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    req = Request("r", [1, 2, 3], p, 0.0, eos_token_id=eos, max_tokens=max_tokens or len(ids) + 1)
    stops = StopChecker(p, tokenizer, max_model_len=10**9)
    texts, finish = [], None
    for token in ids:
        req.output_token_ids.append(token)
        finish = stops.check(req)
        if history:
            texts.append(stops.text)
        if finish is not None:
            break
    return (texts if history else [stops.text]), finish


def byte_ids(text: str) -> list[int]:
    return BYTES.encode(text, add_special_tokens=False)


# ---- examples ----------------------------------------------------------------------------------------------


def test_stop_string_across_token_boundaries_is_cut_off():
    texts, finish = generate(BYTES, byte_ids("Hello, world! END of it"), stop=["END"])
    assert finish == (STOPPED, "END")
    assert texts[-1] == "Hello, world! "
    # "E" and "EN" could still grow into "END": they are never shown.
    assert not any(t.endswith(("E", "EN")) for t in texts)


def test_stop_string_spanning_bpe_tokens(bpe):
    ids = bpe.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    assert not any("fox j" in bpe.decode([i]) for i in ids)  # the stop string spans tokens
    texts, finish = generate(bpe, ids, stop=["fox j", "never"])
    assert finish == (STOPPED, "fox j") and texts[-1] == "the quick brown "


def test_include_stop_str_in_output():
    texts, finish = generate(BYTES, byte_ids("say STOP now"), stop=["STOP"], include_stop_str_in_output=True)
    assert finish == (STOPPED, "STOP") and texts[-1] == "say STOP"


def test_earliest_stop_string_wins():
    _, finish = generate(BYTES, byte_ids("a--b==c"), stop=["==", "--"])
    assert finish == (STOPPED, "--")


def test_multibyte_characters_split_across_tokens_are_held_back():
    texts, finish = generate(BYTES, byte_ids("日本🤖"))
    assert finish is None
    assert texts == ["", "", "日", "日", "日", "日本", "日本", "日本", "日本", "日本🤖"]


def test_eos_and_stop_tokens_are_not_shown():
    texts, finish = generate(BYTES, [*byte_ids("done"), EOS])
    assert finish == (STOPPED, None) and texts[-1] == "done"
    texts, finish = generate(BYTES, [*byte_ids("done."), ord("!")], stop_token_ids=[ord("!")])
    assert finish == (STOPPED, ord("!")) and texts[-1] == "done."
    _, finish = generate(BYTES, [*byte_ids("go"), EOS, *byte_ids("on")], ignore_eos=True)
    assert finish is None


def test_eos_shows_the_held_back_tail():
    # "ST" might have become "STOP"; once EOS ends the request it is plain text.
    texts, finish = generate(BYTES, [*byte_ids("xST"), EOS], stop=["STOP"])
    assert texts == ["", "", "", "xST"] and finish == (STOPPED, None)


def test_length_stop_flushes_what_was_held_back():
    # An unfinished character at max_tokens is shown as U+FFFD, like a full decode of the output.
    texts, finish = generate(BYTES, byte_ids("ab日")[:4], max_tokens=4)
    assert finish == (LENGTH, None) and texts == ["a", "ab", "ab", "ab\ufffd"]
    # A tail held back for a stop string is shown too.
    texts, finish = generate(BYTES, byte_ids("xxST"), max_tokens=4, stop=["STOP"])
    assert finish == (LENGTH, None) and texts[-1] == "xxST"


def test_without_a_tokenizer_the_text_stays_empty():
    texts, finish = generate(None, [5, 6, 7], max_tokens=3, stop=["x"])
    assert texts == ["", "", ""] and finish == (LENGTH, None)


def test_detokenizer_skips_special_tokens_and_keeps_bpe_spacing(bpe):
    ids = bpe.encode(" the lazy dog", add_special_tokens=False)
    detok = Detokenizer(bpe)
    pieces = [detok.push(i) for i in [0, *ids[:2], 0, 0, *ids[2:], 1]] + [detok.flush()]
    assert "".join(pieces) == " the lazy dog" == bpe.decode(ids)


# ---- the incremental text is the full decode ---------------------------------------------------------------


def slow_texts(tokenizer, ids: list[int], max_tokens: int, **params) -> list[str]:
    """What StopChecker must show after each token, the slow way: a full decode of the whole output each time.

    The rules: an incomplete character at the end (U+FFFD) waits unless the request stops by length; the
    last (longest stop - 1) characters wait while a stop string could still complete there; a stop string
    cuts the text; EOS and stop tokens show everything decoded before them.
    """
    p = SamplingParams(max_tokens=None, **params)
    longest = max((len(s) for s in p.stop), default=0)
    shown, texts = "", []
    for k in range(1, len(ids) + 1):
        if (not p.ignore_eos and ids[k - 1] == tokenizer.eos_token_id) or ids[k - 1] in p.stop_token_ids:
            return [*texts, tokenizer.decode(ids[: k - 1])]
        at_length = k >= max_tokens
        text = tokenizer.decode(ids[:k])
        text = text if at_length else text.rstrip("\ufffd")
        start = max(0, len(shown) - longest + 1)
        hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            return [*texts, text[: i + len(s)] if p.include_stop_str_in_output else text[:i]]
        if p.stop and not at_length:
            text = text[: max(len(shown), len(text) - longest + 1)]
        shown = text
        texts.append(text)
        if at_length:
            break
    return texts


STOPS = st.lists(st.sampled_from(["a", "ab", "b 日", "日", "🤖!", "the", " fox", "\ufffd"]), max_size=3)
# Bytes that make, break and complete multi-byte characters, plus ASCII and the special ids.
BYTE_IDS = st.lists(st.one_of(st.integers(0, 257), st.sampled_from([0xF0, 0x9F, 0xA4, 0x96, 0xE6, 0x97, 0xFF, 97])),
                    max_size=60)


def check_against_full_decode(tokenizer, ids, stop, include, ignore_eos, max_tokens):
    params = dict(stop=stop, include_stop_str_in_output=include, ignore_eos=ignore_eos)
    texts, _ = generate(tokenizer, ids, max_tokens=max_tokens, **params)
    assert texts == slow_texts(tokenizer, ids, max_tokens, **params)
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:], strict=False))  # the text only grows
    detok, joined = Detokenizer(tokenizer), ""
    for k, token in enumerate(ids):
        joined += detok.push(token)
        assert joined == tokenizer.decode(ids[: k + 1]).rstrip("\ufffd")
    assert joined + detok.flush() == tokenizer.decode(ids)


@settings(max_examples=300, deadline=None)
@given(BYTE_IDS, STOPS, st.booleans(), st.booleans(), st.integers(1, 70))
def test_incremental_text_is_the_full_decode_byte_tokenizer(ids, stop, include, ignore_eos, max_tokens):
    check_against_full_decode(BYTES, ids, stop, include, ignore_eos, max_tokens)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data(), STOPS, st.booleans(), st.booleans(), st.integers(1, 70))
def test_incremental_text_is_the_full_decode_bpe(bpe, data, stop, include, ignore_eos, max_tokens):
    vocab = bpe.vocab_size
    words = st.text(alphabet="ab 日本🤖!éthe fox", max_size=30).map(lambda s: bpe.encode(s, add_special_tokens=False))
    noise = st.lists(st.integers(0, vocab + 2), max_size=60)  # ids past the vocabulary decode to nothing
    ids = data.draw(st.one_of(words, noise, st.tuples(words, noise, words).map(lambda t: t[0] + t[1] + t[2])))
    check_against_full_decode(bpe, ids, stop, include, ignore_eos, max_tokens)


# ---- cost linear in output length --------------------------------------------------------------------------


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded_ids = inner, 0
        self.eos_token_id = inner.eos_token_id

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


LONG_TEXT = " ".join(CORPUS) * 1000
N = 10_000


@pytest.mark.parametrize("case", ["byte text", "bpe text", "byte garbage", "bpe random ids"])
def test_ten_thousand_tokens_are_checked_in_linear_time(bpe, case):
    tokenizer = BYTES if case.startswith("byte") else bpe
    ids = {"byte text": byte_ids(LONG_TEXT)[:N],
           "bpe text": bpe.encode(LONG_TEXT, add_special_tokens=False)[:N],
           "byte garbage": [0xF0, 0x9F, 0xFF, 0x80, 0xE6] * (N // 5),  # never a whole character
           "bpe random ids": [(i * 7919) % bpe.vocab_size for i in range(N)]}[case]
    assert len(ids) == N
    counting = CountingTokenizer(tokenizer)
    start = time.perf_counter()
    texts, finish = generate(counting, ids, max_tokens=N, history=False, stop=["</answer>!", "STOP!"],
                             ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert finish == (LENGTH, None) and texts[-1] == tokenizer.decode(ids)
    assert counting.decoded_ids < 16 * N  # a full decode per token would be N * N / 2
    assert elapsed < 1.0, f"{N} tokens took {elapsed:.2f} s"
