"""The worker's copies between paged KV tensors and the segment (needs torch: run in the
real-vLLM tier's environment)."""

import pytest
import torch

from kvgate_vllm.blocks import BlockCopier, LayoutMismatch, pin

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
    with pytest.raises(LayoutMismatch, match="after K and V"):
        BlockCopier([torch.zeros(3, NUM_BLOCKS, 4)], NUM_BLOCKS)
    with pytest.raises(LayoutMismatch, match="no KV"):
        BlockCopier([], NUM_BLOCKS)
    copier = BlockCopier([a], NUM_BLOCKS)
    with pytest.raises(ValueError, match="segment has"):
        copier.gather([0, 1], torch.zeros(copier.block_bytes, dtype=torch.uint8))


def test_k_and_v_first_tensors_give_the_same_block_bytes_as_blocks_first_ones():
    torch.manual_seed(1)
    # FlashAttention's [2, num_blocks, block_size, heads, head_size] against a blocks-first
    # [num_blocks, 2, ...] tensor holding the same values.
    kv_first = torch.randn(2, NUM_BLOCKS, 4, 2, 8, dtype=torch.float16)
    blocks_first = kv_first.transpose(0, 1).contiguous()
    a = BlockCopier([kv_first], NUM_BLOCKS)
    b = BlockCopier([blocks_first], NUM_BLOCKS)
    assert a.block_bytes == b.block_bytes == 2 * 4 * 2 * 8 * 2
    seg_a = torch.zeros(3 * a.block_bytes, dtype=torch.uint8)
    seg_b = torch.zeros_like(seg_a)
    a.gather([5, 0, 2], seg_a)
    b.gather([5, 0, 2], seg_b)
    assert torch.equal(seg_a, seg_b)
    # And back: block 5's bytes scattered into block 1 of a K/V-first cache.
    before = kv_first.clone()
    a.scatter(seg_a, [1])
    assert torch.equal(kv_first[:, 1], before[:, 5])
    assert torch.equal(kv_first[:, 0], before[:, 0])


def test_pinning_is_only_for_cuda_caches():
    assert not pin(torch.zeros(64, dtype=torch.uint8), torch.device("cpu"))


def test_the_staged_path_moves_the_same_bytes():
    """The accelerator path (rows assembled in a contiguous buffer on the KV device, one copy
    each way), exercised on CPU tensors."""
    torch.manual_seed(2)
    kv_first = torch.randn(2, NUM_BLOCKS, 4, 2, 8, dtype=torch.float16)
    blocks_first = torch.randn(NUM_BLOCKS, 3, 8, dtype=torch.bfloat16)
    plain = BlockCopier([kv_first, blocks_first], NUM_BLOCKS)
    staged = BlockCopier([kv_first, blocks_first], NUM_BLOCKS)
    staged.staged = True
    seg_a = torch.zeros(3 * plain.block_bytes, dtype=torch.uint8)
    seg_b = torch.zeros_like(seg_a)
    plain.gather([4, 1, 3], seg_a)
    staged.gather([4, 1, 3], seg_b)
    assert torch.equal(seg_a, seg_b)
    before = (kv_first.clone(), blocks_first.clone())
    staged.scatter(seg_b, [0, 2, 5])
    assert torch.equal(kv_first[:, 0], before[0][:, 4])
    assert torch.equal(kv_first[:, 5], before[0][:, 3])
    assert torch.equal(blocks_first[2], before[1][1])


def test_a_two_block_cache_is_read_blocks_first():
    t = torch.zeros(2, 3, 4)
    assert BlockCopier([t], 2).block_bytes == 3 * 4 * 4
