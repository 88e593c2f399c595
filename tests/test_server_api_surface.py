"""What clients read besides completions: `GET /v1/models/{id}`, `/tokenizer_info` (lm-eval's RemoteTokenizer),
the OpenAPI schema (request bodies, true response types), OpenAI's finish_reason values even when a stream is cut
by shutdown, and logprob tokens that keep their exact bytes and never collapse. Fake engine, so it stays fast.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_fake_engine import FakeEngine
from server_helpers import LiveServer, wait_until

from jaxserve.core.tokenizer import ByteTokenizer
from jaxserve.server.app import build_app
from jaxserve.server.token_text import TokenText

OPENAI_FINISH_REASONS = {None, "stop", "length", "tool_calls", "content_filter"}


@pytest.fixture(scope="module")
def served():
    fake = FakeEngine(max_model_len=512)
    with LiveServer(build_app(fake)) as server:
        yield server, fake


def test_a_model_is_retrieved_by_its_id(served) -> None:
    server, _ = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_tokenizer_info_gives_what_lm_eval_reads(served) -> None:
    server, _ = served
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token_id"] == 257 and info["model_max_length"] == 512 and info["vocab_size"] == 512
    assert set(info) >= {"eos_token", "bos_token", "pad_token", "chat_template", "tokenizer_class"}


def test_openapi_documents_every_body_and_response(served) -> None:
    server, _ = served
    doc = httpx.get(f"{server.url}/openapi.json").json()
    paths, schemas = doc["paths"], doc["components"]["schemas"]
    for path, body in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
        op = paths[path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
        assert "prompt" in schemas[body]["properties"] or "messages" in schemas[body]["properties"] or \
            "tokens" in schemas[body]["properties"]
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    streamed = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert streamed["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert streamed["text/event-stream"]["schema"]["$ref"].endswith("/ChatCompletionChunk")
    for path in ("/health", "/metrics"):
        assert list(paths[path]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert paths["/v1/models/{model_id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/ModelCard")
    assert paths["/tokenizer_info"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/TokenizerInfo")
    assert "422" not in paths["/v1/completions"]["post"]["responses"]


def test_a_stream_cut_by_shutdown_never_says_abort() -> None:
    fake = FakeEngine(max_model_len=8192, step_s=0.01)
    with LiveServer(build_app(fake)) as server:
        lines: list[str] = []

        def read() -> None:
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000,
                                    "stream": True}) as s:
                lines.extend(line for line in s.iter_lines() if line)

        t = threading.Thread(target=read)
        t.start()
        assert wait_until(lambda: len(fake.running) == 1, timeout=5)
        server.server.config.app.state.generator.abort_all()
        t.join(10)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and events[-1]["error"]["code"] == "server_shutdown"
    reasons = {c["finish_reason"] for e in events[:-1] for c in e["choices"]}
    assert reasons <= OPENAI_FINISH_REASONS


def test_byte_tokens_keep_their_bytes_and_distinct_keys() -> None:
    text = TokenText(ByteTokenizer())
    assert text.text_and_bytes(ord("a")) == ("a", [97])
    assert text.text_and_bytes(0xE2) == ("bytes:\\xe2", [0xE2])  # part of a character: OpenAI's form
    assert text.text_and_bytes(257) == ("<|eos|>", list(b"<|eos|>"))
    keys = text.keys([0xE2, 0xE3, 0x80, ord("a")])
    assert len(set(keys)) == 4


def test_byte_level_bpe_tokens_keep_their_bytes(tmp_path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxserve.core.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["déjà vu — naïve café"] * 10, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    hf = HFTokenizer(tmp_path)
    text = TokenText(hf)
    lead = tok.token_to_id("â")  # GPT-2's alphabet: the character standing for byte 0xE2, the lead byte of "—"
    assert text.text_and_bytes(lead) == ("bytes:\\xe2", [0xE2])
    ids = hf.encode("naïve café — déjà", add_special_tokens=False)
    assert b"".join(bytes(text.text_and_bytes(t)[1]) for t in ids) == "naïve café — déjà".encode()
    assert len(set(text.keys(list(range(256))))) == 256  # 256 byte tokens, 256 distinct keys
