"""Copies between an engine's paged KV tensors and the shared segment (the worker's data path).

A kvgate block is one engine block across every attention layer: layer after layer (in the KV
cache group's layer order), each layer's part being that layer's tensor at the block's index,
as bytes. Two tensor shapes are taken:

- blocks first, ``[num_blocks, ...]`` (most of vLLM 0.32's backends, the CPU one included):
  the block is ``tensor[block_id]``;
- K and V first, ``[2, num_blocks, ...]`` (e.g. vLLM's ROCm attention backend): the block is
  ``tensor[0][block_id]`` then ``tensor[1][block_id]``, the same bytes a ``[num_blocks, 2, ...]``
  tensor of the same inner shape gives.

Backends whose inner layout differs (FlashAttention in vLLM 0.32 keeps K and V side by side per
head, ``[num_blocks, heads, block_size, 2 * head_size]``) give other bytes for the same
tokens, so blocks are shared only between engines with the same layout.

Copies are batched: one ``index_select``/``index_copy_`` per layer and plane for all blocks of
a batch, which land in consecutive slots of the segment. On an accelerator the rows are
assembled in a contiguous buffer on the device and moved with one copy each way, and ``pin``
page-locks the segment with CUDA, so that copy is a DMA transfer rather than one staged
through pageable memory.
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
            # K/V-first is tested first: with more than two blocks, a blocks-first tensor never
            # has exactly 2 in front, and a K/V-first one always has.
            if t.dim() >= 3 and t.shape[0] == 2 and num_blocks > 2 and t.shape[1] >= num_blocks:
                planes = [t[0], t[1]]
            elif t.dim() >= 2 and t.shape[0] >= num_blocks:
                planes = [t]
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
        #: Assemble rows in a contiguous buffer on the KV device and move them with one copy
        #: (on accelerators: strided copies into host memory would go through pageable
        #: temporaries).
        self.staged = self.device.type != "cpu"

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
        out = torch.empty_like(rows, device=self.device) if self.staged else rows
        for t, offset, per in self._layers:
            data = t.index_select(0, idx).contiguous().view(torch.uint8).view(len(idx), per)
            out[:, offset : offset + per].copy_(data)
        if self.staged:
            rows.copy_(out)

    def scatter(self, segment: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copies slots 0..n-1 of ``segment`` into the blocks."""
        if not block_ids:
            return
        rows, idx = self._batch(segment, block_ids)
        src_rows = rows.to(self.device) if self.staged else rows
        for t, offset, per in self._layers:
            src = src_rows[:, offset : offset + per].contiguous().view(t.dtype)
            t.index_copy_(0, idx, src.view(len(idx), *t.shape[1:]))


class PinError(RuntimeError):
    """CUDA refused to page-lock the staging segment."""


def pin(staging: torch.Tensor, device: torch.device) -> bool:
    """Page-locks ``staging`` (the mapped segment) for CUDA when the KV cache is on a CUDA device.

    Returns ``False`` for other devices, ``True`` once registered. Raises ``PinError`` when CUDA
    refuses, as PyTorch's own pinning does: the CUDA runtime keeps the error as the thread's last
    one, which would surface later at an unrelated kernel launch, so carrying on is not safe
    (the connector's ``pin_staging: false`` turns pinning off). The registration lasts as long as
    the process; the segment is mapped once per worker and kept across reconnects.
    """
    if device.type != "cuda" or staging.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(staging.data_ptr(), staging.numel(), 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise PinError(
            f"cudaHostRegister of the {staging.numel()}-byte staging segment failed (CUDA error "
            f"{code}); set kv_connector_extra_config pin_staging: false to run without pinning"
        )
    return True
