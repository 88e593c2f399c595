"""guidellm, a benchmarking client, against the real server (`tiny`) out of the box: its chat requests stream with
vLLM's `stream_options.continuous_usage_stats`, and every one of them must succeed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
from server_helpers import engine_server

from jaxserve.config.engine import EngineConfig
from tests.conftest import TINY_ENGINE_ARGS


def _guidellm() -> list[str]:
    if importlib.util.find_spec("guidellm") is not None:
        return [sys.executable, "-m", "guidellm"]
    exe = shutil.which("guidellm")
    if exe is None:
        pytest.skip("guidellm is not installed (pip install -e '.[test]')")
    return [exe]


@pytest.fixture(scope="module")
def url():
    with engine_server(EngineConfig(model="tiny", **TINY_ENGINE_ARGS)) as live:
        yield live.url


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """An HF tokenizer for guidellm's synthetic prompts (it counts their tokens; the server has its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    folder = tmp_path_factory.mktemp("guidellm_tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def test_guidellm_benchmarks_without_a_failed_request(url: str, tokenizer_folder, tmp_path) -> None:
    out = tmp_path / "guidellm.json"
    cmd = [*_guidellm(), "run", "--backend", f"kind=openai_http,target={url},model=tiny",
           "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
           "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_folder}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert len(requests["successful"]) == 6 and not requests["errored"] and not requests["incomplete"]
    body = json.loads(requests["successful"][0]["request_args"])["body"]
    assert body["stream_options"]["continuous_usage_stats"] is True  # what used to be refused
