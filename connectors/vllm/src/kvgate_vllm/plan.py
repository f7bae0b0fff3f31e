"""The scheduler side's bookkeeping, with no vLLM types: what to look up, load and save.

vLLM's scheduler calls the connector at three points per request, and this module answers them
from plain values so it is tested without an engine:

- ``match``: a waiting request's blocks after its GPU prefix hit are looked up in the daemon
  (pinned, so an offload elsewhere cannot evict them before the worker loads them); the answer
  is how many tokens the worker will load;
- ``allocated``: the engine admitted the request with that many external tokens; the load is
  planned for the next step;
- ``step``: each scheduled step, the loads planned since the last one, and the blocks that become
  full this step (their KV is written by this step's forward), which the worker offloads after
  it. Every block is offloaded once, when the engine computes it.

Pins are released two steps after the load was handed to the worker (the step that loads it has
run by then, even with vLLM's one-step-ahead asynchronous scheduling), or when the request
finishes; a pin also ends at its deadline in the daemon, whatever happens here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .keys import KeyChain
from .protocol import Found


@dataclass(frozen=True)
class Transfer:
    """Blocks of one request moved between GPU blocks and the daemon, in chain order."""

    req_id: str
    keys: list[int]
    block_ids: list[int]
    #: The key before the first block (offloads only).
    parent: int | None = None


@dataclass(frozen=True)
class Scheduled:
    """One request in a scheduled step."""

    req_id: str
    #: Tokens computed before this step.
    num_computed_tokens: int
    #: Tokens this step computes.
    num_scheduled_tokens: int
    #: The request's GPU block table (its first KV cache group), read only when the step loads
    #: or offloads blocks of the request: vLLM copies it for each read, and most decode steps
    #: need none.
    table: Callable[[], Sequence[int]]


@dataclass
class _Request:
    chain: KeyChain
    #: The request's tokens (prompt, then output: the engine's live list).
    tokens: Sequence[int]
    #: Blocks the daemon has or was offered (held by it at the lookup, loaded from it, or
    #: offloaded): not offloaded again.
    saved: int = 0
    #: Blocks this request has offloaded (a lookup after a preemption does not undo them).
    offered: int = 0
    #: The last lookup: (first block, blocks held, of which in host memory).
    matched: tuple[int, int, int] = (0, 0, 0)
    #: (first block, blocks) to load in the next step, once the engine allocated them.
    load: tuple[int, int] | None = None
    pins: list[list[int]] = field(default_factory=list)
    unpin_at: int | None = None


Lookup = Callable[[list[int]], Found | None]


class Planner:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        self._requests: dict[str, _Request] = {}
        self._step = 0

    def __len__(self) -> int:
        return len(self._requests)

    def _request(self, req_id: str, model: str, tokens: Sequence[int], salt: str | None) -> _Request:
        r = self._requests.get(req_id)
        if r is None:
            r = _Request(KeyChain(model, self.block_size, salt), tokens)
            self._requests[req_id] = r
        r.tokens = tokens
        return r

    def match(
        self,
        req_id: str,
        model: str,
        tokens: Sequence[int],
        salt: str | None,
        num_computed_tokens: int,
        lookup: Lookup,
    ) -> int:
        """Tokens the daemon can supply after the engine's own ``num_computed_tokens`` (a block
        multiple). The last prompt token is never supplied: the engine must compute one token.

        The lookup starts at the chain's first block, not after the GPU hit: it refreshes the
        daemon's copy of a prefix the GPU serves (its least-recently-used order follows real
        use), and when the daemon lacks blocks the GPU holds (it restarted, or evicted them) the
        first step offloads them again, so a hot prefix is not lost to the node for as long as
        the GPU keeps it."""
        r = self._request(req_id, model, tokens, salt)
        bs = self.block_size
        first = num_computed_tokens // bs
        last = (len(tokens) - 1) // bs if tokens else 0
        r.matched = (first, 0, 0)
        r.saved = max(r.saved, first)
        if num_computed_tokens % bs or last == 0:
            return 0
        keys = r.chain.advance(tokens)[:last]
        found = lookup(keys)
        if found is None:
            return 0
        held = min(found.any, len(keys))
        if found.pinned:
            r.pins.append(keys[: min(found.pinned, held)])
        # Blocks [held, first) are on the GPU but not in the daemon: offload them again.
        r.saved = min(r.saved, max(held, r.offered))
        ext = max(0, held - first)
        r.matched = (first, ext, max(0, min(found.host, held) - first))
        return ext * bs

    def hit_sources(self, req_id: str, num_external_tokens: int) -> tuple[int, int]:
        """Of the external tokens, how many come from host memory and how many from lower tiers."""
        r = self._requests.get(req_id)
        if r is None or num_external_tokens <= 0:
            return 0, 0
        host = min(r.matched[2] * self.block_size, num_external_tokens)
        return host, num_external_tokens - host

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        """The engine admitted the request, loading ``num_external_tokens`` from the daemon."""
        r = self._requests.get(req_id)
        if r is None:
            return
        first, held, _ = r.matched
        blocks = min(held, num_external_tokens // self.block_size)
        r.load = None
        if blocks > 0:
            r.load = (first, blocks)
            # The daemon holds everything up to the loaded blocks.
            r.saved = max(r.saved, first + blocks)

    def step(
        self, scheduled: Sequence[Scheduled]
    ) -> tuple[list[Transfer], list[Transfer], list[list[int]]]:
        """A scheduled step: (loads, saves) for the worker, and the pins to release now (one
        list of keys per pinning lookup: each needs its own unpin)."""
        self._step += 1
        bs = self.block_size
        loads: list[Transfer] = []
        saves: list[Transfer] = []
        for s in scheduled:
            r = self._requests.get(s.req_id)
            if r is None:
                continue
            keys = r.chain.advance(r.tokens)
            full = min(s.num_computed_tokens + s.num_scheduled_tokens, len(r.tokens)) // bs
            full = min(full, len(keys))
            if r.load is None and full <= r.saved:
                continue
            table = s.table()
            if r.load is not None:
                first, n = r.load
                r.load = None
                ids = list(table[first : first + n])
                if len(ids) == n and len(keys) >= first + n:
                    loads.append(Transfer(s.req_id, keys[first : first + n], ids))
                    r.unpin_at = self._step + 2
            full = min(full, len(table))
            if full > r.saved:
                parent = keys[r.saved - 1] if r.saved > 0 else None
                saves.append(
                    Transfer(s.req_id, keys[r.saved : full], list(table[r.saved : full]), parent)
                )
                r.saved = full
                r.offered = max(r.offered, full)
        unpin: list[list[int]] = []
        for r in self._requests.values():
            if r.unpin_at is not None and r.unpin_at <= self._step:
                r.unpin_at = None
                unpin.extend(r.pins)
                r.pins = []
        return loads, saves, unpin

    def finished(self, req_id: str) -> list[list[int]]:
        """Forgets the request; returns the pins it still holds."""
        r = self._requests.pop(req_id, None)
        return r.pins if r is not None else []
