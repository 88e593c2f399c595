"""Prompt logprobs through the API (`tiny`): `echo` with `logprobs` (the prompt's tokens first, the first one's
logprob null, as vLLM returns them), `max_tokens: 0` with echo, and vLLM's `prompt_logprobs` field in
completions and chat; each value must be what the engine's own prompt logprobs say.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import engine_server

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from tests.conftest import TINY_ENGINE_ARGS

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server():
    with engine_server(EngineConfig(model="tiny", **TINY_ENGINE_ARGS)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llm: LLM) -> tuple[list[int], list]:
    ids = [256, *PROMPT.encode()]  # BOS, then the bytes: what the server's tokenizer makes of PROMPT
    out = tiny_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    return ids, out.prompt_logprobs


def test_echo_puts_the_prompt_and_its_logprobs_first(client, reference) -> None:
    ids, expected = reference
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0)
    choice = r.choices[0]
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(expected[j][ids[j]], abs=1e-4)
        assert max(lp.top_logprobs[j].values()) == pytest.approx(max(expected[j].values()), abs=1e-4)
    assert r.usage.completion_tokens == 3


def test_max_tokens_zero_with_echo_gives_the_prompt_alone(client, reference) -> None:
    ids, expected = reference
    r = client.completions.create(model="tiny", prompt=[ids], max_tokens=0, logprobs=0, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(
        sum(expected[j][ids[j]] for j in range(1, len(ids))), abs=1e-3)


def test_streamed_echo_leads_with_the_prompt(client) -> None:
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, stream=True,
                                            temperature=0))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, temperature=0)
    assert chunks[0].choices[0].text.startswith(PROMPT) and text == whole.choices[0].text


def test_prompt_logprobs_field_in_completions_and_chat(server, reference) -> None:
    ids, expected = reference
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                            "prompt_logprobs": 2}, timeout=60).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for j in range(1, len(ids)):
        entry = got[j]
        assert entry[str(ids[j])]["logprob"] == pytest.approx(expected[j][ids[j]], abs=1e-4)
        assert 2 <= len(entry) <= 3 and sorted(v["rank"] for v in entry.values() if v["rank"])[:2] == [1, 2]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # without echo nothing would come back
    ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_prompt_logprob_requests_are_400s(server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
