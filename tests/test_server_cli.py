"""`jaxserve serve` as a process: ready line, bad flags, and a clean exit on SIGTERM/SIGINT mid-request."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from cli_helpers import run_cli
from server_helpers import free_port, scrape, wait_until

ROOT = Path(__file__).resolve().parents[1]
# The same engine shape as test_server_openai's, so the persistent compilation cache serves both.
SMALL_ENGINE = ["--model", "tiny", "--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--chunk-size", "64",
                "--kv-cache-memory", "16MiB", "--max-model-len", "2048"]


def _launch(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-c", "from jaxserve.cli.main import main; main()", "serve", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _stderr_lines(proc: subprocess.Popen) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.mark.parametrize("args, mentions", [
    (["--port", "eighty"], "--port"),
    (["--kv-cache-memory", "12XB"], "12XB"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--no-such-flag"], "--no-such-flag"),
    (["tiny", "--model", "small"], "two models given"),
    (["--enforce-eager"], "--enforce-eager cannot apply"),
    (["--tool-call-parser", "mistral"], "--tool-call-parser mistral cannot apply"),
    (["--allowed-origins", "*"], "JSON list"),
    (["--chat-template", "no-such-file.jinja"], "--chat-template"),
])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], mentions: str) -> None:
    code, err = run_cli("serve", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and mentions in err, err


def test_vllm_spellings_reach_the_same_settings() -> None:
    from jaxserve.cli.serve import serve

    ctx = serve.make_context("serve", ["tiny", "--kv-cache-memory-bytes", "16MiB", "--allowed-origins",
                                       '["https://a.example"]', "--disable-log-stats"])
    assert ctx.params["model_tag"] == "tiny" and ctx.params["kv_cache_memory"] == 16 * 2**20
    assert ctx.params["allowed_origins"] == ("https://a.example",) and ctx.params["disable_log_stats"]


def test_half_a_tls_pair_is_refused(tmp_path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("not read before the check")
    code, err = run_cli("serve", "--ssl-keyfile", str(key))
    assert code == 2 and "--ssl-keyfile and --ssl-certfile go together" in err


def test_a_busy_port_is_one_line_before_the_engine_is_built() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _launch("--model", "tiny", "--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    # Our message, from before the engine is built (uvicorn's own came after a warm-up, exit code 3).
    assert len(err.strip().splitlines()) == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_requests_in_flight_exits_0_within_5s(sig: signal.Signals) -> None:
    port = free_port()
    proc = _launch("--port", str(port), "--served-model-name", "srv", *SMALL_ENGINE)
    lines = _stderr_lines(proc)
    try:
        deadline, seen = time.monotonic() + 120, []
        while not any("jaxserve ready" in line for line in seen):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=0.5))
        assert sum("jaxserve ready" in line for line in seen) == 1
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "srv"

        started = threading.Barrier(5)
        ended: list[bool] = []

        def stream() -> None:
            body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                    it = r.iter_lines()
                    next(it)
                    started.wait(30)
                    for _ in it:
                        pass
            except httpx.HTTPError:
                pass
            ended.append(True)

        whole: list[httpx.Response] = []

        def complete() -> None:
            body = {"prompt": "cut me", "max_tokens": 2000, "ignore_eos": True}
            whole.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
        threads.append(threading.Thread(target=complete, daemon=True))
        for t in threads:
            t.start()
        started.wait(30)
        assert wait_until(lambda: scrape(url)["jaxserve:num_requests_running"] >= 5, timeout=30)
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 5
        for t in threads:
            t.join(5)
        assert len(ended) == 4
        # A whole response cut by shutdown is an error, never a 200 with truncated text.
        assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutdown"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_chat_template_is_a_file_or_the_templates_text(tmp_path) -> None:
    from jaxserve.cli.serve_flags import engine_overrides

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    base = {"enforce_eager": False, "enable_auto_tool_choice": True, "tool_call_parser": "hermes", "tokenizer": None}
    assert engine_overrides({**base, "chat_template": str(path)})["chat_template"] == template
    assert engine_overrides({**base, "chat_template": template})["chat_template"] == template
