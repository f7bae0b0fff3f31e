"""The block manager's connector protocol (kvgate-kvbm's ``--socket``): messages and framing.

Pure: no I/O. A frame is a 4-byte big-endian length, then a MessagePack map whose ``op`` field
names the message (docs/kvbm.md, "Connector protocol"; the Rust side is
``kvgate_kvbm::protocol``). Block bytes never travel in frames: they live in the shared-memory
segment passed once at the handshake, and frames name them by byte offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgspec

#: The byte sent with the segment's descriptor attached (SCM_RIGHTS).
HANDSHAKE = b"K"
#: The largest frame either side sends.
MAX_FRAME_BYTES = 1 << 20
#: The most blocks (or keys) one request may name.
MAX_BLOCKS = 4096

_HEADER = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class ProtocolError(Exception):
    """A frame from the daemon that breaks the protocol (too large, undecodable, unexpected)."""


@dataclass(frozen=True)
class Layout:
    """What a block's bytes mean. Connectors see only blocks registered under an equal layout."""

    model: str
    dtype: str
    layers: int
    block_size: int
    block_bytes: int
    shard: int = 0
    shards: int = 1

    def as_map(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "layers": self.layers,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "shard": self.shard,
            "shards": self.shards,
        }


@dataclass(frozen=True)
class Found:
    """A lookup's answer: leading blocks in host memory, in any tier, and how many are pinned."""

    host: int
    any: int
    pinned: int


@dataclass(frozen=True)
class Offloaded:
    stored: int
    present: int
    skipped: int


@dataclass(frozen=True)
class Onboarded:
    """The first ``blocks`` slots of an onboard now hold their blocks."""

    blocks: int
    from_host: int
    from_disk: int
    from_remote: int
    #: Pulled by the block manager from another node's (absent from older daemons: 0).
    from_peer: int = 0


class DaemonError(Exception):
    """The daemon refused a request (``error`` {code, message})."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def closes_connection(self) -> bool:
        """Whether the daemon closes the connection after this error."""
        return self.code in ("malformed", "sequence", "layout")


def frame(message: dict[str, Any]) -> bytes:
    """One request as a frame."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def body_len(header: bytes) -> int:
    """The body length a frame header declares; refuses one above the bound."""
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"the daemon sent a frame of {n} bytes; the limit is {MAX_FRAME_BYTES}")
    return n


def register(layout: Layout, segment_bytes: int) -> dict[str, Any]:
    return {"op": "register", "layout": layout.as_map(), "segment_bytes": segment_bytes}


def _slots(slots: list[tuple[int, int]]) -> list[dict[str, int]]:
    if len(slots) > MAX_BLOCKS:
        raise ValueError(f"{len(slots)} blocks in one request; the limit is {MAX_BLOCKS}")
    return [{"key": k, "offset": o} for k, o in slots]


def offload(parent: int | None, slots: list[tuple[int, int]]) -> dict[str, Any]:
    return {"op": "offload", "parent": parent, "blocks": _slots(slots)}


def onboard(slots: list[tuple[int, int]]) -> dict[str, Any]:
    return {"op": "onboard", "blocks": _slots(slots)}


def lookup(keys: list[int], pin_ms: int = 0) -> dict[str, Any]:
    if len(keys) > MAX_BLOCKS:
        raise ValueError(f"{len(keys)} keys in one request; the limit is {MAX_BLOCKS}")
    return {"op": "lookup", "keys": keys, "pin_ms": pin_ms}


def unpin(keys: list[int]) -> dict[str, Any]:
    if len(keys) > MAX_BLOCKS:
        raise ValueError(f"{len(keys)} keys in one request; the limit is {MAX_BLOCKS}")
    return {"op": "unpin", "keys": keys}


def _field(msg: dict[str, Any], name: str, default: int | None = None) -> int:
    value = msg.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"response field {name!r} is {value!r}, not a count")
    return value


def decode(body: bytes, expect: str) -> Any:
    """Decodes a response body; an ``error`` raises DaemonError, an unexpected op ProtocolError."""
    try:
        msg = _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable response: {e}") from e
    if not isinstance(msg, dict):
        raise ProtocolError(f"response is a {type(msg).__name__}, not a map")
    op = msg.get("op")
    if op == "error":
        raise DaemonError(str(msg.get("code")), str(msg.get("message")))
    if op != expect:
        raise ProtocolError(f"expected {expect!r}, the daemon answered {op!r}")
    if op == "registered":
        return _field(msg, "layout_id")
    if op == "found":
        return Found(_field(msg, "host"), _field(msg, "any"), _field(msg, "pinned", 0))
    if op == "offloaded":
        return Offloaded(_field(msg, "stored"), _field(msg, "present"), _field(msg, "skipped", 0))
    if op == "unpinned":
        return _field(msg, "blocks")
    if op == "onboarded":
        return Onboarded(
            _field(msg, "blocks"),
            _field(msg, "from_host"),
            _field(msg, "from_disk", 0),
            _field(msg, "from_remote"),
            _field(msg, "from_peer", 0),
        )
    raise ProtocolError(f"unknown response {op!r}")
