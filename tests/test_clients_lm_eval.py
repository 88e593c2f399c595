"""lm-eval's `local-completions` against the real server (`tiny`), with a small local task of each kind it
scores through the API: multiple choice (`loglikelihood`: `echo` + `logprobs` + `max_tokens: 1`), rolling
perplexity (`loglikelihood_rolling`) and generation; its tokenizer is the server's (`tokenizer_backend=remote`:
`/tokenizer_info`, `/tokenize`, `/detokenize`). A choice's loglikelihood must be what the engine's own prompt
logprobs say.
"""

from __future__ import annotations

import json
import math

import pytest
from server_helpers import engine_server

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from tests.conftest import TINY_ENGINE_ARGS

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [{"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
             {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
             {"question": "Cats say", "choices": [" meow", " woof", " moo"], "answer": 0}]
TEXTS = [{"text": "It was the best of times, it was the worst of times."},
         {"text": "All happy families are alike; each unhappy family is unhappy in its own way. " * 6}]
TASKS = {
    "jaxserve_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                    "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                    "metric_list": [{"metric": "acc"}]},
    "jaxserve_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]},
    "jaxserve_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": " blue",
                     "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
                     "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def url():
    with engine_server(EngineConfig(model="tiny", **TINY_ENGINE_ARGS)) as live:
        yield live.url


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = {"jaxserve_mc": QUESTIONS, "jaxserve_ppl": TEXTS, "jaxserve_gen": QUESTIONS}
    for name, spec in TASKS.items():
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in data[name]))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
                "test_split": "test", **spec}
        (folder / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML
    return folder


def test_lm_eval_scores_every_kind_of_task(url: str, task_dir, monkeypatch, tiny_llm: LLM) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/v1/completions", "model": "tiny", "tokenizer_backend": "remote",
                    "max_length": 512, "num_concurrent": 2, "max_retries": 1},
        tasks=list(TASKS), task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
        limit=None)
    res = results["results"]
    assert 0 <= res["jaxserve_mc"]["acc,none"] <= 1
    assert math.isfinite(res["jaxserve_ppl"]["word_perplexity,none"]) and res["jaxserve_ppl"]["bits_per_byte,none"] > 0
    assert "exact_match,none" in res["jaxserve_gen"]
    # A choice's loglikelihood is the sum of its tokens' prompt logprobs after the question.
    sample = results["samples"]["jaxserve_mc"][0]
    question, choice = sample["arguments"][0]
    ll_served = sample["resps"][0][0][0]
    context = list(question.encode())
    ids = context + list(choice.encode())
    out = tiny_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    expected = sum(out.prompt_logprobs[j][ids[j]] for j in range(len(context), len(ids)))
    assert ll_served == pytest.approx(expected, abs=1e-3)
