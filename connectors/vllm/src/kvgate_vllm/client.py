"""A connector's side of the block manager's socket: the shared segment and one connection.

One ``Client`` is one connection for one layout. It creates a ``memfd`` segment, maps it, passes
its descriptor to the daemon (the handshake), registers the layout, then sends one request at a
time. Every failure of the connection (the daemon restarted, a timeout, a protocol break) closes
it and raises ``ConnectionLost``; the caller decides when to connect again (``Reconnecting`` does
it with a back-off), so an engine never blocks on a daemon that is gone.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import protocol
from .protocol import (
    MAX_BLOCKS,
    DaemonError,
    Found,
    Layout,
    Offloaded,
    Onboarded,
    ProtocolError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class ConnectionLost(Exception):
    """The connection to the daemon failed or was closed; its pins are released by the daemon."""


class Segment:
    """Shared memory the daemon reads offloaded blocks from and writes onboarded blocks into."""

    def __init__(self, size: int, name: str = "kvgate-connector") -> None:
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"[{offset}, {offset + length}) is outside the {self.size}-byte segment")
        return memoryview(self.map)[offset : offset + length]

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class Client:
    """One registered connection. Not thread-safe: one request at a time, as the protocol is."""

    def __init__(
        self,
        path: str,
        layout: Layout,
        segment: Segment,
        timeout_s: float = 5.0,
    ) -> None:
        self.layout = layout
        self.segment = segment
        self._sock: socket.socket | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            socket.send_fds(sock, [protocol.HANDSHAKE], [segment.fd])
        except OSError as e:
            sock.close()
            raise ConnectionLost(f"cannot connect to the block manager at {path}: {e}") from e
        self._sock = sock
        self.layout_id: int = self._call(protocol.register(layout, segment.size), "registered")

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _recv_exact(self, n: int) -> bytes:
        assert self._sock is not None
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionLost("the block manager closed the connection")
            buf += chunk
        return bytes(buf)

    def _call(self, message: dict[str, Any], expect: str) -> Any:
        if self._sock is None:
            raise ConnectionLost("not connected")
        try:
            self._sock.sendall(protocol.frame(message))
            body = self._recv_exact(protocol.body_len(self._recv_exact(4)))
            return protocol.decode(body, expect)
        except DaemonError as e:
            if e.closes_connection:
                self.close()
            raise
        except (OSError, ProtocolError, ConnectionLost) as e:
            self.close()
            if isinstance(e, ConnectionLost):
                raise
            raise ConnectionLost(f"block manager connection failed: {e}") from e

    def lookup(self, keys: list[int], pin_ms: int = 0) -> Found:
        """Leading blocks of ``keys`` held (host, any tier), pinning them for ``pin_ms``."""
        host = held = pinned = 0
        for start in range(0, len(keys), MAX_BLOCKS):
            chunk = keys[start : start + MAX_BLOCKS]
            found: Found = self._call(protocol.lookup(chunk, pin_ms), "found")
            if host == held:
                host += found.host
            held += found.any
            pinned += found.pinned
            if found.any < len(chunk):
                break
        return Found(host, held, pinned)

    def unpin(self, keys: list[int]) -> int:
        released = 0
        for start in range(0, len(keys), MAX_BLOCKS):
            released += self._call(protocol.unpin(keys[start : start + MAX_BLOCKS]), "unpinned")
        return released

    def offload(self, parent: int | None, slots: list[tuple[int, int]]) -> Offloaded:
        """Stores the blocks in ``slots`` ((key, offset) in chain order after ``parent``)."""
        stored = present = skipped = 0
        for start in range(0, len(slots), MAX_BLOCKS):
            chunk = slots[start : start + MAX_BLOCKS]
            done: Offloaded = self._call(protocol.offload(parent, chunk), "offloaded")
            stored, present, skipped = (
                stored + done.stored,
                present + done.present,
                skipped + done.skipped,
            )
            parent = chunk[-1][0]
        return Offloaded(stored, present, skipped)

    def onboard(self, slots: list[tuple[int, int]]) -> Onboarded:
        """Copies the leading held blocks into their slots; stops at the first not held."""
        total = Onboarded(0, 0, 0, 0)
        for start in range(0, len(slots), MAX_BLOCKS):
            chunk = slots[start : start + MAX_BLOCKS]
            got: Onboarded = self._call(protocol.onboard(chunk), "onboarded")
            total = Onboarded(
                total.blocks + got.blocks,
                total.from_host + got.from_host,
                total.from_disk + got.from_disk,
                total.from_remote + got.from_remote,
                total.from_peer + got.from_peer,
            )
            if got.blocks < len(chunk):
                break
        return total


class Reconnecting:
    """A client that connects on first use and again after a failure: ``retry_s`` after the
    first, doubling after each failure in a row up to ``max_retry_s`` (a daemon that hangs
    costs the engine one ``timeout_s`` per try, not one per request), back to ``retry_s`` once a
    request succeeds. While the daemon is away, ``call`` returns None at once: the engine
    computes what it would have loaded, and offloads are dropped."""

    def __init__(
        self,
        path: str,
        layout: Layout,
        segment_bytes: int,
        timeout_s: float = 2.0,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_retry_s: float = 30.0,
    ) -> None:
        self.path = path
        self.layout = layout
        self.segment = Segment(segment_bytes)
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._max_retry_s = max(retry_s, max_retry_s)
        self._backoff = retry_s
        self._clock = clock
        self._client: Client | None = None
        self._next_try = 0.0
        #: Connections made (the first and every reconnect).
        self.connects = 0
        #: Calls that failed because the connection was lost.
        self.failures = 0

    def _connected(self) -> Client | None:
        if self._client is not None and self._client.connected:
            return self._client
        if self._clock() < self._next_try:
            return None
        try:
            self._client = Client(self.path, self.layout, self.segment, self._timeout_s)
        except (ConnectionLost, DaemonError) as e:
            self._client = None
            self._failed(f"block manager unavailable ({e})")
            return None
        self.connects += 1
        log.info(
            "kvgate: connected to the block manager at %s (layout %d, %d-byte segment)",
            self.path,
            self._client.layout_id,
            self.segment.size,
        )
        return self._client

    def call(self, op: Callable[[Client], T]) -> T | None:
        """Runs ``op`` on a connected client; None when there is none or the call failed."""
        client = self._connected()
        if client is None:
            return None
        try:
            result = op(client)
        except ConnectionLost as e:
            self.failures += 1
            self._failed(f"block manager connection lost: {e}")
            return None
        except DaemonError as e:
            self.failures += 1
            log.warning("kvgate: block manager refused a request: %s", e)
            return None
        self._backoff = self._retry_s
        return result

    def _failed(self, why: str) -> None:
        """No connection until the back-off has passed; the next failure waits twice as long."""
        log.warning("kvgate: %s; retrying in %.1f s", why, self._backoff)
        self._next_try = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, self._max_retry_s)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self.segment.close()
