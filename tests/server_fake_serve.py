"""The server over the fake engine as its own process, set up as `jaxserve serve` sets up its own (uvicorn config,
interpreter setting), for tests that time the server without sharing its GIL:
`python tests/server_fake_serve.py PORT '{"max_num_waiting": 64}'`. Prints "ready" once it listens.
"""

from __future__ import annotations

import json
import sys
import threading

import uvicorn
from server_fake_engine import FakeEngine

from jaxserve.server.app import build_app
from jaxserve.server.limits import ServerLimits
from jaxserve.server.transport import tune_interpreter, uvicorn_config


class _Server(uvicorn.Server):
    async def startup(self, sockets: object = None) -> None:
        await super().startup(sockets)
        print("ready", flush=True)


def main() -> None:
    port, limits = int(sys.argv[1]), ServerLimits(**json.loads(sys.argv[2]))
    app = build_app(FakeEngine(max_model_len=4096, step_s=0.01), limits=limits)
    tune_interpreter()
    server = _Server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"))
    threading.Thread(target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)), daemon=True).start()
    server.run()  # until stdin closes


if __name__ == "__main__":
    main()
