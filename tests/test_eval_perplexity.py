"""`jaxserve eval perplexity`: perplexity from the engine's prompt logprobs agrees with HF transformers' on the same
checkpoint and text (to 0.5%), through the Python API and the command."""

import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaForCausalLM

from jaxserve import LLM
from jaxserve.cli.main import cli, main
from jaxserve.core.tokenizer import load_tokenizer
from jaxserve.measure.eval.agreement import agreement_counts
from jaxserve.measure.eval.perplexity import perplexity
from jaxserve.measure.eval.windows import read_eval_text, token_windows
from modelspec.spec import resolve_model_path

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=128, page_size=16,
              kv_cache_memory=4 * 2**20, token_buckets=(16, 32, 64, 128), warmup=False)
SMALL_ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--chunk-size", "64",
                      "--kv-cache-memory", "4MiB"]


def hf_perplexity(model_name: str, ids: list[int], max_len: int) -> float:
    hf = LlamaForCausalLM.from_pretrained(resolve_model_path(model_name), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in token_windows(ids, max_len):
            lp = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].float(), dim=-1)
            total -= lp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
            count += len(w) - 1
    return math.exp(total / count)


@pytest.fixture(scope="module")
def held_out_ids():
    return load_tokenizer("bard").encode(read_eval_text("bard", "held-out"), add_special_tokens=False)[:3000]


def test_windows_cover_the_text_and_score_all_but_their_first_tokens():
    windows = token_windows(list(range(10)), 4)
    assert windows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert token_windows([1, 2, 3, 4, 5], 4) == [[1, 2, 3, 4]]  # a last lone token scores nothing
    with pytest.raises(ValueError, match="max_len"):
        token_windows([1, 2], 1)


@pytest.mark.parametrize("model", ["bard", "bard-draft"])
def test_perplexity_agrees_with_hf_transformers(model, held_out_ids):
    llm = LLM(model, **ENGINE)
    result = perplexity(llm.engine, held_out_ids, max_len=200)  # windows longer than a step: chunked prefill
    reference = hf_perplexity(model, held_out_ids, 200)
    assert result.num_windows == 15 and result.num_tokens == 3000 - 15
    assert abs(result.perplexity / reference - 1) < 0.005, (result.perplexity, reference)
    assert 1 < result.perplexity < 500  # a trained model: far below uniform guessing over 4096 tokens


def test_the_command_prints_the_same_perplexity(tmp_path, held_out_ids):
    text = read_eval_text("bard", "held-out")[:4000]
    data = tmp_path / "sample.txt"
    data.write_text(text)
    res = CliRunner().invoke(cli, ["eval", "perplexity", "--model", "bard", "--data", str(data), "--max-len", "100",
                                   "--json", *SMALL_ENGINE_FLAGS])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output.strip().splitlines()[-1])
    ids = load_tokenizer("bard").encode(text, add_special_tokens=False)
    assert got["num_tokens"] == len(ids) - len(token_windows(ids, 100))
    assert abs(got["perplexity"] / hf_perplexity("bard", ids, 100) - 1) < 0.005


@pytest.mark.parametrize("args, mentions", [
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--model", "tiny", "--data", "held-out"], "ships no held_out.txt"),
    (["--max-len", "1"], "--max-len"),
])
def test_bad_input_is_one_line_and_exit_2(args, mentions, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "perplexity", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and mentions in err, err


def test_agreement_counts_positions_before_the_first_divergence_and_equal_ones():
    before, equal, total = agreement_counts([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert (before, equal, total) == (2 + 2, 3 + 2, 6)  # the first pair diverges at index 2, then agrees again
