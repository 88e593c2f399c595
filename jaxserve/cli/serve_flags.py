"""`jaxserve serve`'s own flags (beyond the engine's): client limits, and the `vllm serve` server flags a vLLM
user reaches for (CORS, TLS, a root path, tool calling, logprobs, the chat template), each applied or refused
with one line saying why. docs/vllm_flags.md lists every `vllm serve` flag against jaxserve's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from jaxserve.cli.engine_flags import parse_bytes
from jaxserve.server.cors import CORSConfig
from jaxserve.server.limits import ServerLimits

TOOL_CALL_PARSERS = ("hermes",)  # the one format jaxserve parses tool calls in (structured/tools.py)
LIMIT_NAMES = ("api_keys", "max_request_body_bytes", "max_prompts_per_request", "max_num_waiting", "request_timeout",
               "stream_buffer_tokens", "request_read_timeout", "structured_outputs_cache_bytes",
               "structured_outputs_compile_timeout", "max_logprobs")
CORS_NAMES = ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        return value if isinstance(value, int) else parse_bytes(str(value))


class _JSONList(click.ParamType):
    """vLLM's form of the CORS flags: a JSON list of strings, e.g. '["https://a.example"]'."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        try:
            items = json.loads(value)
        except json.JSONDecodeError:
            self.fail(f"{value!r} is not a JSON list of strings (e.g. '[\"*\"]')", param, ctx)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            self.fail(f"{value!r} is not a JSON list of strings (e.g. '[\"*\"]')", param, ctx)
        return tuple(items)


def limit_options(f: Any) -> Any:
    """Server-only flags: vLLM's names where vLLM has the flag, TGI-style names otherwise."""
    d = ServerLimits()
    options = [
        click.option("--api-key", "api_keys", multiple=True, envvar="JAXSERVE_API_KEY",
                     help="Require 'Authorization: Bearer KEY' on every route but /health (vLLM's flag). Repeat for "
                          "several keys; default from $JAXSERVE_API_KEY (several separated by spaces)."),
        click.option("--max-request-body-bytes", type=_Size(), default=d.max_request_body_bytes, show_default=True,
                     help="Largest request body (413 past it; TGI's --payload-limit)."),
        click.option("--max-prompts-per-request", type=click.IntRange(min=1), default=d.max_prompts_per_request,
                     show_default=True, help="Most engine sequences (prompts x n) one request may ask for (400)."),
        click.option("--max-num-waiting", type=click.IntRange(min=0), default=d.max_num_waiting, show_default=True,
                     help="Sequences admitted beyond --max-num-seqs before new requests get 429 with Retry-After "
                          "(TGI-style, as its --max-concurrent-requests)."),
        click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Seconds a request may take from arrival to its last token (504 past it); default none."),
        click.option("--stream-buffer-tokens", type=click.IntRange(min=0), default=d.stream_buffer_tokens,
                     show_default=True, help="Tokens the engine may run ahead of a stream's reader before the request "
                                             "is aborted and its connection closed (0: no bound)."),
        click.option("--request-read-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=d.request_read_timeout, show_default=True,
                     help="Seconds a client has to send a request's headers and body (408 and close past it)."),
        click.option("--structured-outputs-cache-bytes", type=_Size(), default=d.structured_outputs_cache_bytes,
                     show_default=True, help="Memory the compiled grammars of structured outputs and tool calls may "
                                             "hold (an LRU, by bytes); one grammar may take a quarter of it (400 "
                                             "past that)."),
        click.option("--structured-outputs-compile-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=d.structured_outputs_compile_timeout, show_default=True,
                     help="Seconds one grammar may take to compile, in a worker process (400 past it)."),
        click.option("--max-logprobs", type=click.IntRange(min=0), default=d.max_logprobs, show_default=True,
                     help="Most logprobs alternatives a request may ask for per token (vLLM's flag; 400 past it)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def vllm_server_options(f: Any) -> Any:
    """`vllm serve`'s server flags, under vLLM's names and defaults."""
    d = CORSConfig()
    options = [
        click.option("--tokenizer", default=None, help="A folder holding tokenizer.json, in place of the model's."),
        click.option("--chat-template", default=None, metavar="FILE|TEXT",
                     help="A Jinja chat template (a file, or the template's text) in place of the tokenizer's."),
        click.option("--enable-auto-tool-choice", is_flag=True,
                     help="Accepted for vLLM's habit: jaxserve always parses tool calls under tool_choice auto."),
        click.option("--tool-call-parser", default=None, metavar="NAME",
                     help=f"The tool-call format parsed: {', '.join(TOOL_CALL_PARSERS)} (the only one jaxserve has)."),
        click.option("--enforce-eager", is_flag=True,
                     help="Refused: jaxserve always runs XLA-compiled steps (it has no CUDA graphs to turn off)."),
        click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Serve HTTPS with this private key (with --ssl-certfile)."),
        click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Serve HTTPS with this certificate (with --ssl-keyfile)."),
        click.option("--root-path", default="", help="The path prefix a proxy serves the app under (ASGI root_path)."),
        click.option("--disable-log-stats", is_flag=True, help="No periodic stats log line."),
        click.option("--allowed-origins", type=_JSONList(), default=json.dumps(list(d.allowed_origins)),
                     show_default=True, help="CORS: origins browsers may call from, as a JSON list."),
        click.option("--allowed-methods", type=_JSONList(), default=json.dumps(list(d.allowed_methods)),
                     show_default=True, help="CORS: methods allowed, as a JSON list."),
        click.option("--allowed-headers", type=_JSONList(), default=json.dumps(list(d.allowed_headers)),
                     show_default=True, help="CORS: request headers allowed, as a JSON list."),
        click.option("--allow-credentials", is_flag=True, help="CORS: allow credentials (cookies, auth headers)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def server_limits(options: dict[str, Any]) -> ServerLimits:
    """Pop the limit flags out of the command's kwargs into ServerLimits (bad values -> UsageError)."""
    try:
        return ServerLimits(**{k: options.pop(k) for k in LIMIT_NAMES})
    except ValueError as e:  # e.g. an empty --api-key
        raise click.UsageError(str(e)) from None


def cors_config(options: dict[str, Any]) -> CORSConfig:
    """Pop the CORS flags out of the command's kwargs."""
    return CORSConfig(**{k: options.pop(k) for k in CORS_NAMES})


def engine_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the vLLM flags that reach the engine (--tokenizer, --chat-template) or are refused or checked only
    (--enforce-eager, --enable-auto-tool-choice, --tool-call-parser); the EngineConfig fields they set."""
    if options.pop("enforce_eager"):
        raise click.UsageError("--enforce-eager cannot apply: jaxserve always runs XLA-compiled steps (vLLM's flag "
                               "turns off CUDA graphs, which jaxserve does not use); drop the flag")
    options.pop("enable_auto_tool_choice")  # always on: tool_choice auto parses Hermes calls
    parser = options.pop("tool_call_parser")
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise click.UsageError(f"--tool-call-parser {parser} cannot apply: jaxserve parses tool calls in the "
                               f"{'/'.join(TOOL_CALL_PARSERS)} format only (<tool_call>{{...}}</tool_call>)")
    template = options.pop("chat_template")
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    elif template is not None and ("{%" not in template and "{{" not in template):
        raise click.UsageError(f"--chat-template {template}: neither a file nor a Jinja template's text")
    return {"tokenizer": options.pop("tokenizer"), "chat_template": template}


def ssl_files(options: dict[str, Any]) -> dict[str, str]:
    """uvicorn's ssl_keyfile/ssl_certfile from the flags: both or neither."""
    key, cert = options.pop("ssl_keyfile"), options.pop("ssl_certfile")
    if bool(key) != bool(cert):
        raise click.UsageError("--ssl-keyfile and --ssl-certfile go together: give both, or neither")
    return {"ssl_keyfile": key, "ssl_certfile": cert} if key else {}
