"""A bounded flood of ordinary and hostile requests against a loopback server, run as its own process so its
CPU time is not the server's GIL: `python tests/server_flood.py PORT SECONDS MAX_REQUESTS CONNECTIONS`.

Raw HTTP/1.1 over asyncio streams, one request a connection; stops after SECONDS or MAX_REQUESTS, whichever
comes first, and prints {"status": count, ...} as JSON ("error" counts connections that failed).
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time


def _post(path: str, body: bytes, ctype: bytes = b"application/json", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST %s HTTP/1.1\r\nHost: flood\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (path.encode(), ctype, n)) + body


def requests() -> list[bytes]:
    """One of each kind, in the order the flood cycles through them."""
    ok = json.dumps({"prompt": "flood", "max_tokens": 8}).encode()
    stream = json.dumps({"prompt": "flood", "max_tokens": 16, "stream": True, "n": 4}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    return [
        _post("/v1/completions", ok),
        _post("/v1/completions", stream),
        _post("/v1/chat/completions", chat),
        _post("/v1/completions", json.dumps({"prompt": list(range(200)) * 1000}).encode()),  # ~1 MB of ids
        _post("/v1/completions", json.dumps({"prompt": "x" * 1_500_000}).encode()),  # a 1.5 MB text prompt
        _post("/v1/completions", b'{"prompt": "big"', length=50_000_000),  # declared past the limit
        _post("/v1/completions", ok, ctype=b"text/plain"),
        _post("/v1/completions", b"[" * 50_000),
        _post("/v1/completions", json.dumps({"prompt": ["a"] * 200, "n": 64}).encode()),
        _post("/v1/completions", json.dumps({"prompt": "ab", "n": 64, "max_tokens": 64}).encode()),
        _post("/tokenize", json.dumps({"prompt": "y" * 200_000}).encode()),
    ]


async def _one(port: int, raw: bytes) -> str:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(raw)
            await writer.drain()
        except OSError:
            pass  # the server may answer and close before the body is all sent
        data = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "error"
    except OSError:  # TimeoutError is one
        return "error"


async def flood(port: int, seconds: float, max_requests: int, connections: int) -> dict[str, int]:
    kinds, counts = requests(), collections.Counter()
    sent = 0
    end = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal sent
        while sent < max_requests and time.monotonic() < end:
            sent += 1
            counts[await _one(port, kinds[(sent + w) % len(kinds)])] += 1

    await asyncio.gather(*(worker(w) for w in range(connections)))
    return dict(counts)


if __name__ == "__main__":
    port, seconds, max_requests, connections = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(asyncio.run(flood(port, seconds, max_requests, connections))))
