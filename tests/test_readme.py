"""The README's commands, as written: every `jaxserve` line parses against the command line and the planner's
run at once (fast); under `-m slow`, all of them run on a fresh HOME (cold caches: kernel build, kernel timings,
compiles), the server's port aside, and each prints what it promises: visible text, a plan, a benchmark with
no failed request."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path

import click
import pytest
from server_helpers import free_port

from jaxserve.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    """The README's fenced blocks in `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


def shell_commands() -> list[str]:
    """Every command of the bash blocks: continuation lines joined, comments dropped, `a && b` split."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def jaxserve_commands() -> list[list[str]]:
    return [shlex.split(c)[1:] for c in shell_commands() if c.startswith("jaxserve ")]


def parse(args: list[str]) -> None:
    """Parse `jaxserve ARGS` down to its leaf command (flags and values converted), without running it."""
    command: click.Command = cli
    ctx = command.make_context("jaxserve", list(args))
    while isinstance(command, click.Group):
        with warnings.catch_warnings():  # click 8.2 deprecates protected_args; 9.0 keeps them in args
            warnings.simplefilter("ignore", DeprecationWarning)
            remaining = [*ctx.protected_args, *ctx.args]
        name, command, rest = command.resolve_command(ctx, remaining)
        ctx = command.make_context(name, rest, parent=ctx)


def test_the_readme_opens_with_install_and_serve_then_install_and_test() -> None:
    first = shell_commands()[:4]
    assert first == ["pip install -e .", "jaxserve serve", "pip install -e '.[test]'", "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[test]' && python -m pytest\n" in ci


@pytest.mark.parametrize("args", jaxserve_commands(), ids=" ".join)
def test_every_readme_command_parses(args: list[str]) -> None:
    parse(args)


def test_the_readme_plans_run(tmp_path) -> None:
    for args in jaxserve_commands():
        if args[0] == "plan":
            done = _run(["jaxserve", *args], tmp_path, timeout=120)
            assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_the_readme_talks_to_the_model_the_server_serves() -> None:
    from jaxserve.cli.engine_flags import SERVING_DEFAULT_MODEL

    client, offline = blocks("python")[1], blocks("python")[0]
    assert f'model="{SERVING_DEFAULT_MODEL}"' in client and f'model="{SERVING_DEFAULT_MODEL}"' in offline


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _run(argv: list[str], home: Path, timeout: float) -> subprocess.CompletedProcess:
    if argv[0] == "jaxserve":  # this checkout's, whatever `jaxserve` is on PATH
        argv = [sys.executable, "-c", "from jaxserve.cli.main import main; main()", *argv[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(home), cwd=home)


def _visible(text: str) -> bool:
    return any(ch.isprintable() and not ch.isspace() and ch != "\ufffd" for ch in text)


@pytest.mark.slow
def test_the_readme_runs_as_written_on_a_fresh_home(tmp_path) -> None:
    home, port = tmp_path, free_port()
    local = lambda text: text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")  # noqa: E731 (the one change)
    serve = [sys.executable, "-c", "from jaxserve.cli.main import main; main()", "serve", "--port", str(port)]
    server = subprocess.Popen(serve, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env(home),
                              cwd=home)
    try:
        t0, lines = time.monotonic(), []
        for line in server.stderr:  # type: ignore[union-attr]
            lines.append((time.monotonic() - t0, line))
            if "jaxserve ready" in line:
                break
        assert lines and lines[0][0] < 5, lines[:3]  # something on the log within 5 s of a cold start
        assert any("compiling" in line for _, line in lines), "".join(line for _, line in lines)
        client = _run([sys.executable, "-c", local(blocks("python")[1])], home, timeout=120)
        assert client.returncode == 0 and _visible(client.stdout), client.stderr
        for command in shell_commands():
            if command.startswith("jaxserve ") and not command.startswith(("jaxserve serve", "jaxserve plan")):
                done = _run(shlex.split(local(command)), home, timeout=600)
                assert done.returncode == 0 and _visible(done.stdout), (command, done.stderr[-2000:])
                assert "failed" not in done.stderr, (command, done.stderr[-2000:])
        offline = _run([sys.executable, "-c", blocks("python")[0]], home, timeout=600)
        assert offline.returncode == 0 and _visible(offline.stdout), offline.stderr[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
