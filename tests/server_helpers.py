"""A uvicorn server in a background thread on a free loopback port, for live-server tests."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from jaxserve.config.engine import EngineConfig
from jaxserve.server.limits import ServerLimits
from jaxserve.server.transport import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """Serves `app` with uvicorn in a daemon thread, configured as `jaxserve serve` does; `url` is its base URL."""

    def __init__(self, app: Any, limits: ServerLimits | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, "127.0.0.1", self.port, limits or ServerLimits(), log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def engine_server(config: EngineConfig) -> Iterator[LiveServer]:
    """The real app on a started `AsyncEngine` of `config`, live; the engine is shut down on exit."""
    from jaxserve.engine.async_engine import AsyncEngine  # JAX loads only for the tests that serve a real engine
    from jaxserve.server.app import build_app

    engine = AsyncEngine(config)
    engine.start()
    try:
        with LiveServer(build_app(engine)) as live:
            yield live
    finally:
        engine.shutdown()


def scrape(url: str) -> dict[str, float]:
    """Unlabelled view of /metrics: {'jaxserve:num_requests_running': 0.0, ...} (first sample per name)."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$", line)
        if m:
            values.setdefault(m.group(1), float(m.group(3)))
    return values


def sample(url: str, name: str, **labels: str) -> float:
    """One labelled sample from /metrics (model_name aside), 0 when absent."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\} (\S+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
    return 0.0


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ServerLog(logging.Handler):
    """Records of the server's loggers (uvicorn's do not propagate to pytest's caplog) while in use."""

    NAMES = ("uvicorn", "uvicorn.error", "jaxserve")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> ServerLog:
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)

    def problems(self) -> list[str]:
        """Error lines and tracebacks logged."""
        return [self.format(r) for r in self.records if r.levelno >= logging.ERROR or r.exc_info]
