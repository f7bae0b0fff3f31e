"""Copies between an engine's paged KV tensors and the shared segment (the worker's data path).

A kvgate block is one engine block across every attention layer: layer after layer (in the KV
cache group's layer order), each layer's part being that layer's tensor at the block's index,
as bytes. vLLM's per-layer tensors come in two shapes: blocks first (``[num_blocks, ...]``, the
CPU and FlashInfer backends; one block of one layer is ``tensor[block_id]``) and K/V first
(``[2, num_blocks, ...]``, FlashAttention on GPUs; the block is ``tensor[0][block_id]`` then
``tensor[1][block_id]``). Both give the same bytes for a block (its K part, then its V part), so
blocks move between engines whatever their attention backend. Copies are batched: one
``index_select``/``index_copy_`` per layer and plane for all blocks of a batch, which land in
consecutive slots of the segment.

On a GPU, ``pin`` page-locks the segment with CUDA (``cudaHostRegister``), so those copies are
DMA transfers rather than copies staged through pageable memory.
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
        # One entry per plane: (blocks-first view, offset in a block, bytes per block).
        self._layers: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for i, t in enumerate(layers):
            if t.dim() >= 2 and t.shape[0] >= num_blocks:
                planes = [t]
            elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] >= num_blocks:
                planes = [t[0], t[1]]
            else:
                raise LayoutMismatch(
                    f"layer {i}: KV tensor of shape {tuple(t.shape)} has its {num_blocks} "
                    "blocks neither in the first dimension nor in the second after K and V"
                )
            for plane in planes:
                per = plane[0].numel() * plane.element_size()
                self._layers.append((plane, offset, per))
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


def pin(staging: torch.Tensor, device: torch.device) -> bool:
    """Page-locks ``staging`` (the mapped segment) for CUDA when the KV cache is on a CUDA device.

    Returns whether it did: ``False`` for other devices, and when the driver refuses (the copies
    then still work, through pageable memory). The registration lasts as long as the process;
    the segment is mapped once per worker and kept across reconnects.
    """
    if device.type != "cuda" or staging.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(staging.data_ptr(), staging.numel(), 0)
    code = int(getattr(err, "value", err))
    return code == 0
