"""Copies between an engine's paged KV tensors and the shared segment (the worker's data path).

A kvgate block is one engine block across every attention layer: layer after layer (in the KV
cache group's layer order), each layer's part being that layer's tensor at the block's index,
as bytes. vLLM's per-layer views put blocks first (``[num_blocks, ...]``), so one block of one
layer is ``tensor[block_id]``. Copies are batched: one ``index_select``/``index_copy_`` per layer
for all blocks of a batch, which land in consecutive slots of the segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LayoutMismatch(ValueError):
    """The engine's KV tensors are not what the connector's layout declares."""


class BlockCopier:
    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        num_blocks: int,
        block_bytes: int | None = None,
    ) -> None:
        if not layers:
            raise LayoutMismatch("no KV cache layers")
        self._layers: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for i, t in enumerate(layers):
            if t.dim() < 2 or t.shape[0] < num_blocks:
                raise LayoutMismatch(
                    f"layer {i}: KV tensor of shape {tuple(t.shape)} does not have its "
                    f"{num_blocks} blocks in the first dimension"
                )
            per = t[0].numel() * t.element_size()
            self._layers.append((t, offset, per))
            offset += per
        self.block_bytes = offset
        if block_bytes is not None and block_bytes != offset:
            raise LayoutMismatch(
                f"the KV tensors hold {offset} bytes per block, the layout declares {block_bytes}"
            )
        self.device = layers[0].device

    def _batch(self, segment: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots 0..n-1 of ``segment`` as rows of a block each, and the block ids as an index."""
        n = len(block_ids)
        need = n * self.block_bytes
        if need > segment.numel():
            raise ValueError(f"{n} blocks need {need} bytes; the segment has {segment.numel()}")
        rows = segment[:need].view(n, self.block_bytes)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return rows, idx

    def gather(self, block_ids: Sequence[int], segment: torch.Tensor) -> None:
        """Copies the blocks into slots 0..n-1 of ``segment`` (a uint8 tensor)."""
        if not block_ids:
            return
        rows, idx = self._batch(segment, block_ids)
        for t, offset, per in self._layers:
            data = t.index_select(0, idx).contiguous().view(torch.uint8).view(len(idx), per)
            rows[:, offset : offset + per].copy_(data)

    def scatter(self, segment: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copies slots 0..n-1 of ``segment`` into the blocks."""
        if not block_ids:
            return
        rows, idx = self._batch(segment, block_ids)
        for t, offset, per in self._layers:
            src = rows[:, offset : offset + per].contiguous().view(t.dtype)
            t.index_copy_(0, idx, src.view(len(idx), *t.shape[1:]).to(self.device))
