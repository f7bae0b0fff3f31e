"""The worker's copies between paged KV tensors and the segment (needs torch: run in the
real-vLLM tier's environment)."""

import pytest
import torch

from kvgate_vllm.blocks import BlockCopier, LayoutMismatch

NUM_BLOCKS = 6


def layers():
    torch.manual_seed(0)
    a = torch.randn(NUM_BLOCKS, 2, 4, 8, dtype=torch.bfloat16)
    # A per-layer view whose blocks are not outermost in memory (vLLM's LHBNC-style layouts).
    physical = torch.randn(2, NUM_BLOCKS, 4, 8, dtype=torch.bfloat16)
    b = physical.permute(1, 0, 2, 3)
    assert not b.is_contiguous()
    return [a, b], physical


def test_blocks_gathered_then_scattered_elsewhere_are_the_same_values():
    (a, b), _ = layers()
    copier = BlockCopier([a, b], NUM_BLOCKS)
    assert copier.block_bytes == 2 * (2 * 4 * 8 * 2)
    seg = torch.zeros(4 * copier.block_bytes, dtype=torch.uint8)
    copier.gather([4, 1], seg)
    before = [a.clone(), b.clone()]
    copier.scatter(seg, [0, 5])
    assert torch.equal(a[0], before[0][4]) and torch.equal(a[5], before[0][1])
    assert torch.equal(b[0], before[1][4]) and torch.equal(b[5], before[1][1])
    # Blocks not named are untouched.
    for i in (1, 2, 3, 4):
        assert torch.equal(a[i], before[0][i]) and torch.equal(b[i], before[1][i])


def test_a_block_is_its_layers_bytes_in_order():
    (a, b), _ = layers()
    copier = BlockCopier([a, b], NUM_BLOCKS)
    seg = torch.zeros(copier.block_bytes, dtype=torch.uint8)
    copier.gather([3], seg)
    half = copier.block_bytes // 2
    assert torch.equal(seg[:half], a[3].contiguous().view(torch.uint8).flatten())
    assert torch.equal(seg[half:], b[3].contiguous().view(torch.uint8).flatten())


def test_tensors_that_disagree_with_the_layout_are_refused():
    (a, b), _ = layers()
    with pytest.raises(LayoutMismatch, match="declares"):
        BlockCopier([a, b], NUM_BLOCKS, block_bytes=64)
    with pytest.raises(LayoutMismatch, match="first dimension"):
        BlockCopier([a], NUM_BLOCKS + 1)
    with pytest.raises(LayoutMismatch, match="no KV"):
        BlockCopier([], NUM_BLOCKS)
    copier = BlockCopier([a], NUM_BLOCKS)
    with pytest.raises(ValueError, match="segment has"):
        copier.gather([0, 1], torch.zeros(copier.block_bytes, dtype=torch.uint8))
