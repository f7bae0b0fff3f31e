"""kvgate block keys: the content addresses the router, the sidecars and the block manager share.

The formula (docs/architecture.md, "Block keys"):

- a prompt's tokens are cut into full blocks of the engine's block size; a partial last block
  has no key;
- ``seed = xxh3_64(model_or_lora ‖ 0x00 ‖ salt)``, where vLLM's ``cache_salt`` is *not* part of
  the seed: vLLM mixes it into the first block as an extra key, so kvgate does the same
  (``msgpack([salt])`` appended to block 0's bytes);
- ``key_0 = xxh3_64(seed ‖ tokens_0 [‖ extra])``, ``key_i = xxh3_64(key_{i-1} ‖ tokens_i)``, with
  the seed and keys as little-endian u64 and tokens as little-endian u32.

The Rust side is ``kvgate_kv_events::key``; ``tests/test_keys.py`` pins the same values as its
tests, so the two cannot drift apart silently.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgspec
import xxhash

_U64 = struct.Struct("<Q")


def seed(model_or_lora: str, salt: str | None = None) -> int:
    """The chain's seed for a model (or LoRA adapter) name and an SGLang-style salt."""
    return xxhash.xxh3_64_intdigest(
        model_or_lora.encode() + b"\x00" + (salt or "").encode()
    )


def vllm_salt_extra_key(salt: str) -> bytes:
    """vLLM's extra key for a ``cache_salt``: the MessagePack array ``[salt]``."""
    return msgspec.msgpack.encode([salt])


class KeyChain:
    """A request's keys, extended as its tokens grow (prompt, then generated tokens).

    ``advance`` keys every full block not keyed yet; keys already computed are never recomputed,
    so a long decode costs one hash per new block.
    """

    __slots__ = ("_block_size", "_first_extra", "_seed", "keys")

    def __init__(
        self, model_or_lora: str, block_size: int, cache_salt: str | None = None
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self._block_size = block_size
        self._seed = seed(model_or_lora)
        self._first_extra = vllm_salt_extra_key(cache_salt) if cache_salt else b""
        self.keys: list[int] = []

    @property
    def block_size(self) -> int:
        return self._block_size

    def advance(self, tokens: Sequence[int]) -> list[int]:
        """Keys the full blocks of ``tokens`` (a longer prefix of the same sequence each call)
        not keyed yet, and returns all keys so far."""
        bs = self._block_size
        full = len(tokens) // bs
        prev = self.keys[-1] if self.keys else self._seed
        for i in range(len(self.keys), full):
            block = tokens[i * bs : (i + 1) * bs]
            data = _U64.pack(prev) + struct.pack(f"<{bs}I", *block)
            if i == 0:
                data += self._first_extra
            prev = xxhash.xxh3_64_intdigest(data)
            self.keys.append(prev)
        return self.keys


def block_keys(
    model_or_lora: str,
    tokens: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[int]:
    """The keys of every full block of ``tokens`` (one-off convenience)."""
    return KeyChain(model_or_lora, block_size, cache_salt).advance(tokens)
