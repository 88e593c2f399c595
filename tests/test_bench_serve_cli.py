"""`jaxserve bench serve --base-url` against a server (the fake engine, so it stays fast): defaults that fit the
server's context, an error when every request fails, and help and flags for a remote server only."""

from __future__ import annotations

import pytest
from cli_helpers import run_cli
from server_fake_engine import FakeEngine
from server_helpers import LiveServer

from jaxserve.server.app import build_app


@pytest.fixture(scope="module")
def url():
    with LiveServer(build_app(FakeEngine(max_model_len=256))) as server:
        yield server.url


def test_the_defaults_work_against_the_server(url, capsys) -> None:
    code, err = run_cli("bench", "serve", "--base-url", url, "--num-prompts", "4")
    out = capsys.readouterr().out
    assert code == 0, err
    assert "4 random requests of 224 prompt and 32 output tokens" in err and "max_model_len 256" in err
    assert "Successful requests:                     4" in out


def test_every_request_failing_is_an_error(url, capsys) -> None:
    code, err = run_cli("bench", "serve", "--base-url", url, "--num-prompts", "2", "--input-len", "300")
    assert code == 2
    assert err.splitlines()[-1].startswith("error: 2 of 2 requests failed: HTTP 400")


def test_engine_flags_are_refused_with_a_server(url) -> None:
    code, err = run_cli("bench", "serve", "--base-url", url, "--max-num-seqs", "4")
    assert code == 2 and "--max-num-seqs configures an engine in this process" in err


def test_help_after_base_url_shows_only_what_applies_to_a_server(capsys) -> None:
    run_cli("bench", "serve", "--help")
    everything = capsys.readouterr().out
    run_cli("bench", "serve", "--base-url", "http://x", "--help")
    remote = capsys.readouterr().out
    assert "--max-num-seqs" in everything and "--max-num-seqs" not in remote
    assert "--num-prompts" in remote and "--request-rate" in remote
