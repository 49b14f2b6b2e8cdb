"""CUDA ``decode_merged`` (split-K decode over a fixed-capacity store with device-side lengths, one more partial
merged in the same merge) against the PyTorch reference."""

import pytest
import torch

from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.kernels.decode_merged import decode_merged
from flashquant_hf.packing import packed_size
from flashquant_hf.reference.decode_merged import decode_merged as reference_decode_merged


def _inputs(batch, q_heads, kv_heads, capacity, head_dim, k_bits, v_bits, seed, with_bias):
    g = torch.Generator("cuda").manual_seed(seed)
    dev = "cuda"

    def codes(bits):
        return torch.randint(0, 256, (batch, kv_heads, capacity, packed_size(head_dim, bits)), generator=g,
                             device=dev, dtype=torch.int64).to(torch.uint8)

    q = torch.randn(batch, q_heads, 1, head_dim, generator=g, device=dev).to(torch.bfloat16)
    k_norms = torch.rand(batch, kv_heads, capacity, generator=g, device=dev) + 0.5
    v_norms = torch.rand(batch, kv_heads, capacity, generator=g, device=dev) + 0.5
    k_cent = lloyd_max_codebook(head_dim, k_bits).tensors(dev)[0]
    v_cent = lloyd_max_codebook(head_dim, v_bits).tensors(dev)[0]
    lengths = torch.randint(0, capacity + 1, (batch,), generator=g, device=dev).to(torch.int32)
    lengths[0] = capacity  # one full row, one empty row
    if batch > 1:
        lengths[1] = 0
    bias = None
    if with_bias:
        bias = torch.zeros(batch, capacity, device=dev)
        bias[:, :3] = float("-inf")  # left padding
    extra_out = torch.randn(batch, q_heads, 1, head_dim, generator=g, device=dev)
    extra_lse = torch.randn(batch, q_heads, 1, generator=g, device=dev) * 3
    return (q, codes(k_bits), k_norms, codes(v_bits), v_norms, k_cent, v_cent, lengths, bias, extra_out, extra_lse,
            k_bits, v_bits, head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (3, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("capacity", [100, 4096])
def test_decode_merged_matches_reference(head_dim, bits, with_bias, capacity):
    args = _inputs(4, 32, 8, capacity, head_dim, *bits, seed=capacity + head_dim, with_bias=with_bias)
    out, lse = decode_merged(*args)
    want_out, want_lse = reference_decode_merged(*args)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)


def test_decode_merged_captures_in_a_cuda_graph():
    """Replaying a captured call follows the lengths written into the same tensor between replays."""
    args = list(_inputs(2, 16, 4, 1024, 128, 4, 4, seed=5, with_bias=False))
    lengths = args[7]
    lengths.copy_(torch.tensor([100, 700], dtype=torch.int32))
    decode_merged(*args)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode_merged(*args)
    for values in ([100, 700], [1024, 0], [513, 64]):
        lengths.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        want_out, want_lse = reference_decode_merged(*args)
        torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=2e-3)
        torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
