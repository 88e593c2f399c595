"""One process's endpoint of `jax.experimental.transfer`: offers blocks to peers and pulls blocks from them.

`start_transfer_server(client, address, transport_addresses)` listens on `address` (the control socket whose
address peers are given) and moves bulk data over the transport addresses. A block offered with `await_pull` is
held by the server until a peer pulls it or the offer's deadline passes, then released. A pull of a uuid that
was never offered, or has expired, blocks until the peer closes the connection (jax 0.10.2 on CPU: the pull's own
timeout is not honoured; the GIL is released meanwhile) and leaves the connection unusable. So a pull is never
started past `not_after` (the caller's view of the offer's deadline), the caller bounds its wait, and a
connection that failed or timed out is dropped: the next pull opens a new one.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time

import jax
from jax.experimental import transfer

log = logging.getLogger("jaxserve.disagg")


class TransferEndpoint:
    """This process's transfer server (one per process) and its connections to peers."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.device = jax.devices()[0]
        bind = f"[{host}]" if ":" in host else host
        self.server = transfer.start_transfer_server(self.device.client, f"{bind}:{port}", [f"{bind}:0"])
        self._lock = threading.Lock()
        self._connections: dict[str, transfer.TransferConnection] = {}

    @property
    def address(self) -> str:
        """The control address peers connect to."""
        return self.server.address()

    def offer(self, block: jax.Array, timeout_s: float) -> int:
        """Hold `block` for one pull under a fresh uuid; released after the pull, or after `timeout_s`."""
        uuid = secrets.randbits(62)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self.server.await_pull(uuid, [block], timeout=deadline)
        return uuid

    def _connection(self, address: str) -> transfer.TransferConnection:
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self.server.connect(address)
            return conn

    def drop(self, address: str, conn: transfer.TransferConnection | None = None) -> None:
        """Forget the connection to `address` (only `conn`, when given): the next pull opens a new one."""
        with self._lock:
            if address in self._connections and conn in (None, self._connections[address]):
                del self._connections[address]

    def pull(self, address: str, uuid: int, shape: tuple[int, ...], dtype: str, timeout_s: float,
             not_after: float | None = None) -> jax.Array:
        """Pull one offered block onto this process's first device (blocking; call it off the event loop), unless
        `time.monotonic()` is past `not_after`. Raises RuntimeError with a one-line reason when the peer or the
        offer is gone."""
        if not_after is not None and time.monotonic() > not_after:
            raise RuntimeError(f"KV offer from {address} expired before it could be pulled")
        conn = self._connection(address)
        spec = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype),
                                    sharding=jax.sharding.SingleDeviceSharding(self.device))
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            (block,) = conn.pull(uuid, [spec], timeout=deadline)
            return jax.block_until_ready(block)
        except Exception as e:  # the transfer library raises JaxRuntimeError; the connection is then unusable
            self.drop(address, conn)
            raise RuntimeError(f"KV pull from {address} failed: {str(e).splitlines()[0][:200]}") from None
