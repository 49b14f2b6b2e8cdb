"""The CPU table lookups (``flashquant_hf/cpu/decompress.py``) against the reference: bit for bit, every width."""

from __future__ import annotations

import pytest
import torch

from flashquant_hf import ops
from flashquant_hf.cpu import decompress as cpu
from flashquant_hf.packing import pack_indices
from flashquant_hf.reference import decompress as reference


def _codes(bits: int, head_dim: int, tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, 1 << bits, (2, 3, tokens, head_dim), generator=gen)
    norms = torch.rand(2, 3, tokens, generator=gen) + 0.5
    centroids = torch.randn(1 << bits, generator=gen).sort().values
    return pack_indices(indices, bits), norms, centroids


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("tokens", [1, 7, 97])
def test_table_lookup_equals_the_reference_bit_for_bit(bits, head_dim, tokens):
    packed, norms, centroids = _codes(bits, head_dim, tokens, seed=bits * 1000 + head_dim + tokens)
    want = reference.dequantize_rotated(packed, norms, centroids, bits, head_dim)
    assert torch.equal(cpu.dequantize_rotated(packed, norms, centroids, bits, head_dim), want)
    assert torch.equal(cpu.centroid_values(packed, centroids, bits, head_dim),
                       reference.centroid_values(packed, centroids, bits, head_dim))
    # The store hands the ops views of a longer buffer (non-contiguous in the token axis).
    view = slice(tokens // 3, tokens)
    got = cpu.dequantize_rotated(packed[:, :, view], norms[:, :, view], centroids, bits, head_dim)
    assert torch.equal(got, want[:, :, view])


@pytest.mark.parametrize("bits, head_dim", [(3, 12), (2, 6), (1, 12)])
def test_widths_without_whole_groups_take_the_reference(bits, head_dim):
    assert cpu.unsupported(head_dim, bits) is not None
    packed, norms, centroids = _codes(bits, head_dim, 5, seed=3)
    got = ops.dequantize_rotated(packed, norms, centroids, bits, head_dim, backend="torch")
    assert torch.equal(got, reference.dequantize_rotated(packed, norms, centroids, bits, head_dim))


def test_ops_choose_the_table_lookup_for_cpu_tensors_on_the_torch_backend():
    packed = torch.zeros(1, 1, 2, 32, dtype=torch.uint8)
    assert ops._reference_unless_served("dequantize_rotated", "decompress", "torch", (packed,), 64, 4) is cpu
    assert ops._reference_unless_served("decompress", "decompress", "torch", (packed,), 64, 4) is reference
    assert cpu.unsupported(64, 4) is None


def test_bad_packed_raises():
    with pytest.raises(ValueError, match="`packed` must be uint8 of shape \\[..., 32\\]"):
        cpu.centroid_values(torch.zeros(3, 31, dtype=torch.uint8), torch.zeros(16), 4, 64)
