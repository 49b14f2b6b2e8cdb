"""GPU tests of ``kernels/decode_merged.py`` (split-K decode over a fixed-capacity store with device-side lengths,
one more partial merged in the same merge) against a float64 reference: errors within 2x those of PyTorch computing
the same attention in the kernel's dtype (tests/tolerance.py)."""

import math

import pytest
import torch
from tolerance import assert_attention_within_dtype_error

from flashquant_hf.reference.decode_merged import decode_merged as reference_decode_merged
from flashquant_hf.reference.merge_partials import merge_partials

from .decode_helpers import DEV, centroids, compute_dtype, decode_in_dtype
from .poison import poisoned_allocations
from .test_tq_decode import random_cache


def _inputs(batch, q_heads, kv_heads, capacity, head_dim, bits, seed, with_bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    store = random_cache(batch, kv_heads, capacity, head_dim, capacity_extra=64, seed=seed, k_bits=bits[0],
                         v_bits=bits[1])
    q = torch.randn(batch, q_heads, 1, head_dim, device=DEV, generator=g).to(torch.bfloat16)
    lengths = torch.randint(0, capacity + 1, (batch,), device=DEV, generator=g).to(torch.int32)
    lengths[0] = capacity  # a full row
    lengths[1] = 0  # an empty one: the extra part alone
    bias = None
    if with_bias:
        bias = torch.zeros(batch, capacity, device=DEV)
        bias[:, :3] = -math.inf  # left padding
    extra_out = torch.randn(batch, q_heads, 1, head_dim, device=DEV, generator=g)
    extra_lse = torch.randn(batch, q_heads, 1, device=DEV, generator=g) * 3
    extra_lse[-1] = -math.inf  # an extra part that saw nothing
    return (q, *store, centroids(head_dim, bits[0]), centroids(head_dim, bits[1]), lengths, bias, extra_out,
            extra_lse, *bits, head_dim**-0.5)


def check(result, args):
    """decode_merged's (out, lse) against the float64 reference, within 2x PyTorch's error in the kernel's dtype."""
    q, kp, kn, vp, vn, kc, vc, lengths, bias, extra_out, extra_lse, k_bits, v_bits, scale = args
    exact = reference_decode_merged(q.double(), *args[1:])
    live = torch.arange(kp.shape[2], device=DEV)[None, :] < lengths[:, None]
    full_bias = torch.zeros(live.shape, device=DEV).masked_fill(~live, -math.inf)
    if bias is not None:
        full_bias = full_bias + bias
    out_c, lse_c = decode_in_dtype(q, kp, kn, vp, vn, kc, vc, k_bits, v_bits, scale, full_bias)
    in_dtype = merge_partials(torch.stack([out_c.float(), extra_out]), torch.stack([lse_c.float(), extra_lse]))
    assert_attention_within_dtype_error(result, exact, in_dtype, compute_dtype(q.dtype))


@pytest.mark.parametrize("capacity", [100, 4133])
@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (3, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_merged_matches_reference(capacity, bits, head_dim, with_bias):
    from flashquant_hf.kernels.decode_merged import decode_merged

    args = _inputs(4, 32, 8, capacity, head_dim, bits, seed=capacity + head_dim + bits[1], with_bias=with_bias)
    check(decode_merged(*args), args)


def test_decode_merged_outputs_poisoned_before_launch():
    """Every output and workspace element is written: torch.empty hands out NaN-filled buffers."""
    from flashquant_hf.kernels import decode_launch
    from flashquant_hf.kernels.decode_merged import decode_merged

    args = _inputs(2, 8, 2, 5000, 128, (4, 4), seed=12)  # several splits
    decode_launch.clear_caches()
    with poisoned_allocations():
        result = decode_merged(*args)
    check(result, args)


def test_decode_merged_empty_store_is_the_extra_part():
    from flashquant_hf.kernels.decode_merged import decode_merged

    args = _inputs(2, 8, 2, 0 + 1, 128, (4, 4), seed=3)
    args = (args[0], *(t[:, :, :0] for t in args[1:5]), *args[5:])
    out, lse = decode_merged(*args)
    extra_out, extra_lse = args[9], args[10]
    assert torch.equal(lse, extra_lse)
    assert torch.equal(out, torch.where(torch.isfinite(extra_lse)[..., None], extra_out, 0))


def test_decode_merged_replays_in_a_cuda_graph():
    """A captured call follows the lengths written into the same tensor between replays."""
    from flashquant_hf.kernels.decode_merged import decode_merged

    args = _inputs(2, 16, 4, 1024, 128, (4, 4), seed=5)
    lengths = args[7]
    decode_merged(*args)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode_merged(*args)
    for values in ([100, 700], [1024, 0], [513, 64]):
        lengths.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check((out, lse), args)
