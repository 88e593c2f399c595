"""The files a token crosses from the HTTP handler to the jitted step, counted on the real server.

One completion request goes through `build_app` in process (the ASGI app over an `AsyncEngine`); a profile hook
in every thread records the call stack, as jaxserve files, each time one of the request's hand-overs runs: the
route handler (`/v1/completions`), giving it to the engine (`AsyncEngine.generate`), the engine thread taking it in
(`LLMEngine.add_request`, `Scheduler.add_request`), laying it out in a step (`build_ragged_batch`,
`StepLayout.pack`) and dispatching the jitted forward (`ModelRunner.forward`). The union of those stacks is the
path.

    python scripts/token_path.py [--model tiny]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (file under jaxserve/, function name): the points at which the request changes hands.
HANDOVERS = {("server/routes_generate.py", "completions"), ("engine/async_engine.py", "generate"),
             ("engine/llm_engine.py", "add_request"),
             ("scheduler/scheduler.py", "add_request"), ("core/batch.py", "build_ragged_batch"),
             ("runner/step_inputs.py", "pack"), ("runner/model_runner.py", "forward")}


def _jaxserve_file(path: str) -> str | None:
    p = Path(path).resolve()
    base = ROOT / "jaxserve"
    return str(p.relative_to(base)) if base in p.parents else None


class PathRecorder:
    """A profile hook that unions the jaxserve files on the stack at each hand-over."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.seen: set[tuple[str, str]] = set()
        self.lock = threading.Lock()

    def __call__(self, frame, event, arg):  # sys.setprofile's signature
        if event != "call":
            return
        name = _jaxserve_file(frame.f_code.co_filename)
        if name is None or (name, frame.f_code.co_name) not in HANDOVERS:
            return
        stack = []
        f = frame
        while f is not None:
            if (n := _jaxserve_file(f.f_code.co_filename)) is not None:
                stack.append(n)
            f = f.f_back
        with self.lock:
            self.seen.add((name, frame.f_code.co_name))
            self.files.update(stack)


def token_path(model: str = "tiny", **engine_args) -> tuple[list[str], set[tuple[str, str]]]:
    """(the files, sorted; the hand-overs that were seen) for one completion request served by `model`."""
    from fastapi.testclient import TestClient

    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import build_app

    engine = AsyncEngine(EngineConfig(model=model, **engine_args))
    recorder = PathRecorder()
    threading.setprofile(recorder)  # threads started from here on: the engine loop's, the test client's
    sys.setprofile(recorder)
    try:
        engine.start()
        with TestClient(build_app(engine)) as client:
            r = client.post("/v1/completions", json={"model": engine.config.model_name, "prompt": "Hello",
                                                     "max_tokens": 2, "temperature": 0})
            r.raise_for_status()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        engine.shutdown()
    return sorted(recorder.files), recorder.seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    files, seen = token_path(args.model, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=64,
                             kv_cache_memory=8 * 2**20, max_model_len=512)
    for f in files:
        print(f"jaxserve/{f}")
    missing = HANDOVERS - seen
    print(f"{len(files)} files" + (f"; hand-overs not seen: {sorted(missing)}" if missing else ""))


if __name__ == "__main__":
    main()
