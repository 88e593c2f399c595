"""jaxserve starts and serves without llguidance (an image with jax preinstalled may lack it); only structured
outputs are refused, with a clear error. Run in a subprocess where importing llguidance fails."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
sys.modules["llguidance"] = None  # `import llguidance` now raises ImportError
from jaxserve import LLM, SamplingParams
from jaxserve.core.sampling_params import StructuredOutputsParams
llm = LLM(model="tiny", max_num_seqs=2, max_num_batched_tokens=32, chunk_size=32, kv_cache_memory=4 << 20,
          max_model_len=128, token_buckets=(32,), seq_buckets=(2,))
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))[0]
try:
    llm.generate(["Hi"], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[ab]+")))
    error = None
except ValueError as e:
    error = str(e)
print(json.dumps({"tokens": out.token_ids, "error": error, "loaded": "llguidance" in sys.modules
                  and sys.modules["llguidance"] is not None}))
"""


def test_the_engine_serves_without_llguidance_and_refuses_grammars_clearly():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 3 and not result["loaded"]
    assert "pip install llguidance" in result["error"]
