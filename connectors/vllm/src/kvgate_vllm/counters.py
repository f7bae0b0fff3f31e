"""The connector's counters (pure): what each side counts, and how vLLM's stats plumbing
merges them.

Each side (scheduler, worker) counts into a ``Counts``; vLLM collects ``take()``'s deltas
every step (``get_kv_connector_stats``), sums them across workers and sides, and the
connector's Prometheus metrics (``vllm:kvgate_<name>_total``) add them up."""

from __future__ import annotations

from collections.abc import Mapping

#: name -> help text. Every counter the connector keeps.
COUNTERS: dict[str, str] = {
    "lookups": "Lookups of a waiting request's blocks in the block manager.",
    "lookups_failed": "Lookups not answered (the block manager unreachable or refusing).",
    "loaded_blocks": "Blocks loaded from the block manager into the engine's KV cache.",
    "loaded_from_disk_blocks": "Of the loaded blocks, those the block manager read from disk.",
    "loaded_from_remote_blocks": "Of the loaded blocks, those it fetched from its remote store.",
    "loaded_from_peer_blocks": "Of the loaded blocks, those it pulled from another node's block manager.",
    "load_failed_blocks": "Blocks that could not be loaded (recomputed by the engine).",
    "offloaded_blocks": "Blocks the block manager stored.",
    "offload_skipped_blocks": "Offloaded blocks it did not store (no room, or over a budget).",
    "offload_dropped_blocks": "Blocks not offloaded because it was unreachable or refusing.",
}


class Counts:
    """Counters since the last ``take``."""

    __slots__ = ("_delta",)

    def __init__(self) -> None:
        self._delta: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        if n:
            self._delta[name] = self._delta.get(name, 0) + n

    def take(self) -> dict[str, int]:
        """The counts since the last call; resets them."""
        delta, self._delta = self._delta, {}
        return delta


def merge(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Sums two deltas (vLLM aggregates workers' and the scheduler's stats this way)."""
    out = dict(a)
    for name, n in b.items():
        out[name] = out.get(name, 0) + n
    return out
