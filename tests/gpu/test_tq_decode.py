"""GPU tests of the contiguous-layout split-K decode (``kernels/tq_decode.py``) against a float64 reference: errors
within 2x those of PyTorch computing the same attention in the kernel's dtype (tests/tolerance.py)."""

import math

import pytest
import torch
from tolerance import assert_attention_within_dtype_error

from flashquant_hf import store_layout
from flashquant_hf.packing import packed_size
from flashquant_hf.reference.tq_attention import tq_attention as reference_attention

from .decode_helpers import DEV, WIDTHS, centroids, compute_dtype, decode_in_dtype
from .poison import poisoned_allocations


def random_cache(batch, kv_heads, num_keys, head_dim, capacity_extra=0, seed=0, k_bits=4, v_bits=4):
    """Random packed codes and norms as views [:, :, :N] of a larger capacity buffer (like the HF cache)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    cap = num_keys + capacity_extra
    k = torch.randint(0, 256, (batch, kv_heads, cap, packed_size(head_dim, k_bits)), dtype=torch.uint8, device=DEV,
                      generator=g)
    v = torch.randint(0, 256, (batch, kv_heads, cap, packed_size(head_dim, v_bits)), dtype=torch.uint8, device=DEV,
                      generator=g)
    kn = torch.rand(batch, kv_heads, cap, device=DEV, generator=g) * 8 + 0.5
    vn = torch.rand(batch, kv_heads, cap, device=DEV, generator=g) * 4 + 0.5
    return k[:, :, :num_keys], kn[:, :, :num_keys], v[:, :, :num_keys], vn[:, :, :num_keys]


def check(result, q_rot, cache, k_centroids, v_centroids=None, bits=(4, 4), key_bias=None, scale=None):
    """tq_decode's (out, lse) against the float64 reference, within 2x PyTorch's error in the kernel's dtype."""
    v_centroids = k_centroids if v_centroids is None else v_centroids
    scale = q_rot.shape[-1] ** -0.5 if scale is None else scale
    args = (*cache, k_centroids, v_centroids, *bits, scale)
    exact = reference_attention(q_rot.double(), *args, key_bias=key_bias)
    in_dtype = decode_in_dtype(q_rot, *args, key_bias)
    assert_attention_within_dtype_error(result, exact, in_dtype, compute_dtype(q_rot.dtype))


def run(q_rot, cache, c, key_bias=None, scale=None):
    from flashquant_hf.kernels.tq_decode import tq_decode

    scale = q_rot.shape[-1] ** -0.5 if scale is None else scale
    return tq_decode(q_rot, *cache, c, c, 4, 4, scale, key_bias=key_bias)


@pytest.mark.parametrize("num_keys", [1, 7, 97, 1000, 4133])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tq_decode_matches_reference(num_keys, group, head_dim, cuda_gen):
    batch, kv_heads = 2, 2
    cache = random_cache(batch, kv_heads, num_keys, head_dim, capacity_extra=37, seed=num_keys + group)
    q = torch.randn(batch, kv_heads * group, 1, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(head_dim)
    out, lse = run(q, cache, c)
    assert out.shape == (batch, kv_heads * group, 1, head_dim) and lse.shape == (batch, kv_heads * group, 1)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    check((out, lse), q, cache, c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tq_decode_query_dtypes(dtype, cuda_gen):
    cache = random_cache(3, 4, 2000, 128, seed=5)
    q = (torch.randn(3, 16, 1, 128, device=DEV, generator=cuda_gen) * 2).to(dtype)
    c = centroids(128)
    check(run(q, cache, c), q, cache, c)


@pytest.mark.parametrize("magnitude", [1e-6, 1e5])
def test_tq_decode_query_scale_outside_fp16_range(magnitude, cuda_gen):
    """Queries far outside fp16's range (fp32 input) are rescaled by a power of two inside the kernel."""
    cache = random_cache(2, 2, 600, 128, seed=13)
    q = torch.randn(2, 8, 1, 128, device=DEV, generator=cuda_gen) * magnitude
    scale = 128**-0.5 / magnitude  # same scores as unit queries
    c = centroids(128)
    out, lse = run(q, cache, c, scale=scale)
    check((out, lse), q, cache, c, scale=scale)


@pytest.mark.parametrize("bits", [(3, 3), (3, 2), (4, 3)])
def test_tq_decode_staged_steps_refill_their_stages(bits, cuda_gen):
    """Staged contiguous tiles over splits of several 128-key steps (64 units: four splits of 512-640 keys), so every
    stage is refilled, the last split ending in a partial tile; outputs poisoned first."""
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.tq_decode import tq_decode

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("staged tiles are an sm_90 build")
    num_keys = 2125
    cache = random_cache(8, 8, num_keys, 128, capacity_extra=15, seed=sum(bits), k_bits=bits[0], v_bits=bits[1])
    q = torch.randn(8, 32, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c_k, c_v = centroids(128, bits[0]), centroids(128, bits[1])
    dl.clear_caches()
    with poisoned_allocations():
        result = tq_decode(q, *cache, c_k, c_v, *bits, 128**-0.5)
    (setup,) = dl._LAUNCHES.values()
    assert dl.TMA_OPTION in setup.options, setup
    assert setup.plan.splits > 1 and setup.plan.split_len >= 4 * dl.GRANULE, setup.plan
    check(result, q, cache, c_k, c_v, bits=bits)


def test_tq_decode_long_context_gqa4(cuda_gen):
    cache = random_cache(2, 8, 32768, 128, seed=7)
    q = torch.randn(2, 32, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    check(run(q, cache, c), q, cache, c)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_tq_decode_prefetch_distances(prefetch, monkeypatch, cuda_gen):
    """L2 prefetch on the contiguous layout (off by default there), with a partial last chunk per split."""
    import flashquant_hf.kernels.decode_launch as dl

    monkeypatch.setattr(dl, "CONTIGUOUS_PREFETCH_CHUNKS", prefetch)
    dl.clear_caches()
    cache = random_cache(2, 4, 6001, 128, capacity_extra=11, seed=40 + prefetch)
    q = torch.randn(2, 16, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    check(run(q, cache, c), q, cache, c)
    dl.clear_caches()


@pytest.mark.parametrize("pattern", ["rising", "late_spike", "falling"])
def test_tq_decode_running_max_moves(pattern, cuda_gen):
    """The running max is reduced across lanes and the accumulators rescaled only when some lane's score
    exceeds it (one vote otherwise): key norms that rise with the position move it in almost every tile, a single
    large key late in a split moves it once after it has settled, falling norms never move it after the start."""
    batch, kv_heads, num_keys = 2, 2, 5000
    k, kn, v, vn = random_cache(batch, kv_heads, num_keys, 128, seed=17)
    ramp = torch.linspace(0.5, 12.0, num_keys, device=DEV)
    if pattern == "rising":
        kn = (kn * 0 + ramp).contiguous()
    elif pattern == "falling":
        kn = (kn * 0 + ramp.flip(0)).contiguous()
    else:
        kn = kn.clone()
        kn[:, :, num_keys - 40] = 60.0  # late in the last split of every (sequence, head)
    q = torch.randn(batch, kv_heads * 4, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    cache = (k, kn, v, vn)
    check(run(q, cache, c), q, cache, c)


def test_tq_decode_head_dim_256_and_group_16(cuda_gen):
    cache = random_cache(1, 2, 777, 256, seed=8)
    q = torch.randn(1, 32, 1, 256, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)  # group 16: 2 CTAs per head
    c = centroids(256)
    check(run(q, cache, c), q, cache, c)


def test_tq_decode_non_contiguous_query_and_norms(cuda_gen):
    k, kn, v, vn = random_cache(2, 2, 300, 128, seed=9)
    kn_t = kn.transpose(0, 1).contiguous().transpose(0, 1)  # other stride order, same values
    q_big = torch.randn(2, 8, 3, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    q = q_big[:, :, 1:2]  # a non-contiguous query view
    c = centroids(128)
    cache = (k, kn_t, v, vn)
    check(run(q, cache, c), q, cache, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["misaligned", "strided"])
def test_tq_decode_queries_the_vector_load_cannot_take(layout, dtype, cuda_gen):
    """Queries one element off the vector alignment, or with a head-dim stride of 2, take the scalar loads."""
    cache = random_cache(2, 2, 333, 128, seed=12)
    if layout == "misaligned":
        q = torch.randn(2, 8, 1, 129, device=DEV, dtype=dtype, generator=cuda_gen)[..., 1:]
    else:
        q = torch.randn(2, 8, 1, 256, device=DEV, dtype=dtype, generator=cuda_gen)[..., ::2]
    c = centroids(128)
    check(run(q, cache, c), q, cache, c)


def test_tq_decode_key_bias_padding(cuda_gen):
    batch, num_keys = 3, 500
    cache = random_cache(batch, 2, num_keys, 128, seed=11)
    q = torch.randn(batch, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    bias = torch.zeros(batch, num_keys, device=DEV)
    bias[0, :123] = -math.inf  # left padding
    bias[1, 17::3] = -math.inf  # holes
    bias[2] = -math.inf  # a row that sees nothing: lse -inf, out 0
    c = centroids(128)
    out, lse = run(q, cache, c, bias)
    assert torch.all(lse[2] == -math.inf) and torch.all(out[2] == 0)
    check((out, lse), q, cache, c, key_bias=bias)


def test_tq_decode_outputs_poisoned_before_launch(cuda_gen):
    """The kernel must write every output element: make torch.empty hand out NaN-filled buffers."""
    cache = random_cache(2, 2, 5000, 128, seed=12)  # several splits -> workspace + merge
    q = torch.randn(2, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    import flashquant_hf.kernels.decode_launch as dl

    dl.clear_caches()
    with poisoned_allocations():
        out, lse = run(q, cache, c)
    check((out, lse), q, cache, c)


def test_tq_decode_empty_cache(cuda_gen):
    cache = random_cache(2, 2, 0, 128)
    q = torch.randn(2, 4, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    out, lse = run(q, cache, centroids(128))
    assert torch.all(lse == -math.inf) and torch.all(out == 0)


def test_tq_decode_validation_errors(cuda_gen):
    from flashquant_hf.kernels.tq_decode import tq_decode

    k, kn, v, vn = random_cache(1, 2, 10, 128)
    c = centroids(128)
    q = torch.randn(1, 4, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    with pytest.raises(ValueError, match="`k_packed` must be uint8"):
        tq_decode(q, k.float(), kn, v, vn, c, c, 4, 4, 0.1)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        tq_decode(q[:, :3], k, kn, v, vn, c, c, 4, 4, 0.1)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        tq_decode(q[..., :96], k, kn, v, vn, c, c, 4, 4, 0.1)
    with pytest.raises(ValueError, match=r"`k_bits` must be one of \(1, 2, 3, 4\)"):
        tq_decode(q, k, kn, v, vn, c, c, 5, 4, 0.1)
    with pytest.raises(ValueError, match=r"`k_centroids` must be float32 of shape \[4\]"):
        tq_decode(q, k, kn, v, vn, c, c, 2, 4, 0.1)
    with pytest.raises(ValueError, match=r"`k_packed` must be uint8 of shape \[1, H_kv, N, 32\]"):
        tq_decode(q, k, kn, v, vn, centroids(128, 2), c, 2, 4, 0.1)
    with pytest.raises(ValueError, match="`key_bias` must be"):
        tq_decode(q, k, kn, v, vn, c, c, 4, 4, 0.1, key_bias=torch.zeros(1, 11, device=DEV))


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tq_decode_warp_variants(warps, head_dim, monkeypatch, cuda_gen):
    """Both CTA shapes (template W): multi-split, key_bias, fp16 queries and GQA 4."""
    import flashquant_hf.kernels.decode_launch as dl

    monkeypatch.setattr(dl, "WARPS", warps)
    dl.clear_caches()
    batch, num_keys = 2, 9000
    cache = random_cache(batch, 2, num_keys, head_dim, capacity_extra=5, seed=30 + warps)
    c = centroids(head_dim)
    q = torch.randn(batch, 8, 1, head_dim, device=DEV, dtype=torch.float16, generator=cuda_gen)
    bias = torch.zeros(batch, num_keys, device=DEV)
    bias[1, :77] = -math.inf
    check(run(q, cache, c), q, cache, c)
    check(run(q, cache, c, bias), q, cache, c, key_bias=bias)
    dl.clear_caches()


def test_tq_decode_fast_launch_matches_cupy_launch(monkeypatch, cuda_gen):
    """The cached cuLaunchKernel path and CuPy's launch give identical bits, and the reused parameter array
    follows changing lengths, strides and pointers between calls (as in a decode loop over layers)."""
    import flashquant_hf.kernels.decode_launch as dl

    c = centroids(128)
    k, kn, v, vn = random_cache(2, 2, 6000, 128, capacity_extra=100, seed=40)
    for num_keys in (6000, 257, 4100, 6000):
        cache = (k[:, :, :num_keys], kn[:, :, :num_keys], v[:, :, :num_keys], vn[:, :, :num_keys])
        q = torch.randn(2, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
        monkeypatch.setattr(dl, "FAST_LAUNCH", True)
        fast = run(q, cache, c)
        monkeypatch.setattr(dl, "FAST_LAUNCH", False)
        slow = run(q, cache, c)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
        check(fast, q, cache, c)


def test_tq_decode_programmatic_launch_back_to_back(monkeypatch, cuda_gen):
    """Programmatic dependent launches of many multi-split calls queued without a sync (each decode overwrites the
    partials the previous merge reads) give the bits of ordinary launches; a launch without cuLaunchKernelEx
    falls back."""
    import flashquant_hf.kernels.loader as loader
    import flashquant_hf.kernels.decode_launch as dl

    c = centroids(128)
    k, kn, v, vn = random_cache(4, 2, 9000, 128, capacity_extra=50, seed=41)
    cache = (k, kn, v, vn)
    queries = [torch.randn(4, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen) for _ in range(12)]
    results = {}
    for programmatic in (False, True):
        monkeypatch.setattr(dl, "PROGRAMMATIC_LAUNCH", programmatic)
        dl.clear_caches()
        results[programmatic] = [run(q, cache, c) for q in queries]
        torch.cuda.synchronize()
    assert dl._LAUNCHES and next(iter(dl._LAUNCHES.values())).plan.splits > 1
    for (p_out, p_lse), (o_out, o_lse) in zip(results[True], results[False]):
        assert torch.equal(p_out, o_out) and torch.equal(p_lse, o_lse)
    check(results[True][-1], queries[-1], cache, c)
    monkeypatch.setattr(dl, "PROGRAMMATIC_LAUNCH", True)
    monkeypatch.setattr(loader, "_driver", lambda: None)
    fallback = run(queries[0], cache, c)
    assert torch.equal(fallback[0], results[False][0][0])


def test_tq_decode_balanced_places(monkeypatch, cuda_gen):
    """Contiguous layout with the first-place-longer splits of ``balance_places`` (sms / 2 units x 4 splits), with
    key_bias padding: both plans match the float64 reference."""
    import flashquant_hf.kernels.decode_launch as dl

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // 4
    c = centroids(128)
    cache = random_cache(batch, 2, 16384, 128, capacity_extra=30, seed=91)  # 4 splits of 4K: room for 1.09x
    q = torch.randn(batch, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    bias = torch.zeros(batch, 16384, device=DEV)
    bias[3, 1000:] = -math.inf
    results = {}
    for speedup in (1.09, 1.0):
        monkeypatch.setattr(dl, "FIRST_PLACE_SPEEDUP", speedup)
        dl.clear_caches()
        results[speedup] = run(q, cache, c, bias)
        plans = [s.plan for s in dl._LAUNCHES.values()]
        assert plans and all((p.long_splits is not None) == (speedup != 1.0) for p in plans), plans
    for result in results.values():
        check(result, q, cache, c, key_bias=bias)
    dl.clear_caches()


def check_widths(q, cache, k_bits, v_bits, key_bias=None):
    """tq_decode over k_bits / v_bits codes with its outputs poisoned (NaN) first, checked like ``check``."""
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.tq_decode import tq_decode

    head_dim = q.shape[-1]
    ck, cv = centroids(head_dim, k_bits), centroids(head_dim, v_bits)
    scale = head_dim**-0.5
    dl.clear_caches()
    with poisoned_allocations():
        out, lse = tq_decode(q, *cache, ck, cv, k_bits, v_bits, scale, key_bias=key_bias)
    check((out, lse), q, cache, ck, cv, (k_bits, v_bits), key_bias)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_tq_decode_every_width(bits, group, cuda_gen):
    """Every (key, value) code width at head_dim 128 (paired build for groups <= 4, 8 slots above), N not a multiple
    of the tile, rows of a larger capacity buffer."""
    cache = random_cache(2, 2, 1111, 128, capacity_extra=21, seed=100 + 4 * bits[0] + bits[1], k_bits=bits[0],
                         v_bits=bits[1])
    q = torch.randn(2, 2 * group, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check_widths(q, cache, *bits)


@pytest.mark.parametrize("bits", [(3, 3), (3, 2), (2, 2), (4, 3), (1, 1), (2, 1)])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("num_keys", [1, 97, 3000])
def test_tq_decode_widths_head_dims(bits, head_dim, num_keys, cuda_gen):
    """The cache presets' widths at head_dim 64 (3-bit value slices of 3 bytes at odd offsets) and 256."""
    cache = random_cache(2, 2, num_keys, head_dim, capacity_extra=5, seed=num_keys + head_dim, k_bits=bits[0],
                         v_bits=bits[1])
    q = torch.randn(2, 8, 1, head_dim, device=DEV, dtype=torch.float16, generator=cuda_gen)
    check_widths(q, cache, *bits)


@pytest.mark.parametrize("bits", [(3, 3), (3, 2), (1, 1)])
def test_tq_decode_widths_key_bias_and_empty(bits, cuda_gen):
    """Padding bias (a row whose keys are all masked gets lse -inf and out 0) and an empty cache."""
    cache = random_cache(3, 2, 700, 128, seed=9, k_bits=bits[0], v_bits=bits[1])
    bias = torch.zeros(3, 700, device=DEV)
    bias[0, :300] = float("-inf")
    bias[2] = float("-inf")
    q = torch.randn(3, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check_widths(q, cache, *bits, key_bias=bias)
    empty = random_cache(3, 2, 0, 128, capacity_extra=16, k_bits=bits[0], v_bits=bits[1])
    check_widths(q, empty, *bits)


def test_tq_decode_prepared_call_follows_every_pointer(cuda_gen):
    """Calls of one signature after the first reuse its prepared launch and only rewrite pointers: each call of a
    loop over different caches, queries, centroids and key biases (one and several splits) gives its own result;
    the outputs are poisoned before every launch."""
    import flashquant_hf.kernels.decode_launch as dl

    dl.clear_caches()
    for num_keys, batch in ((5000, 2), (300, 2)):  # several splits (workspace + merge), then one
        caches = [random_cache(batch, 2, num_keys, 128, capacity_extra=11, seed=60 + i) for i in range(3)]
        books = [centroids(128) * s for s in (1.0, 0.5, 2.0)]
        for round_ in range(2):
            for i, cache in enumerate(caches):
                q = torch.randn(batch, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
                bias = torch.zeros(batch, num_keys, device=DEV)
                bias[i % batch, : 17 * (i + 1)] = -math.inf
                c = books[(i + round_) % 3]
                with poisoned_allocations():
                    result = run(q, cache, c, bias)
                check(result, q, cache, c, key_bias=bias)
    assert dl._PREPARED, "the calls above should have gone through a prepared launch"
    dl.clear_caches()


def test_tq_decode_prepared_call_still_rejects_misaligned_codes(cuda_gen):
    """A cached signature does not skip the per-call alignment check: the same shapes and strides at an address
    the vector loads cannot take raise the checks' error."""
    from flashquant_hf.kernels.tq_decode import tq_decode

    k, kn, v, vn = random_cache(1, 2, 40, 128)
    c = centroids(128)
    q = torch.randn(1, 4, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    tq_decode(q, k, kn, v, vn, c, c, 4, 4, 0.1)
    flat = torch.zeros(k.numel() + 8, dtype=torch.uint8, device=DEV)
    shifted = flat[8:].view(1, 2, 40, 64)
    assert shifted.stride() == k.stride() and shifted.data_ptr() % 16 == 8
    with pytest.raises(ValueError, match="`k_packed` needs a contiguous last dimension and 16-byte aligned rows"):
        tq_decode(q, shifted, kn, v, vn, c, c, 4, 4, 0.1)


@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (3, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [4, 8])
def test_tq_decode_staged_and_register_tiles(bits, head_dim, group, monkeypatch, cuda_gen):
    """Contiguous runs bulk-copied per tile into shared memory (sm_90, widths whose register loads are narrow, rows
    packed and every run 16-byte aligned) and the register loads (TMA_TILES False, other widths, or a capacity whose
    norm runs are not 16-byte aligned) all equal the
    reference: several splits with a partial last tile (read from global memory), one key, 17 keys; outputs
    poisoned first."""
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.tq_decode import tq_decode

    staged_available = torch.cuda.get_device_capability()[0] == 9
    c_k, c_v = centroids(head_dim, bits[0]), centroids(head_dim, bits[1])
    for num_keys in (4100, 1, 17):
        for extra, tma in ((12, True), (13, True), (12, False)):  # capacity % 4 == 0: norm runs 16-byte aligned
            monkeypatch.setattr(dl, "TMA_TILES", tma)
            dl.clear_caches()
            cache = random_cache(2, 2, num_keys, head_dim, capacity_extra=extra + (-num_keys) % 4,
                                 seed=num_keys + extra, k_bits=bits[0], v_bits=bits[1])
            q = torch.randn(2, 2 * group, 1, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
            with poisoned_allocations():
                result = tq_decode(q, *cache, c_k, c_v, *bits, head_dim**-0.5)
            (setup,) = dl._LAUNCHES.values()
            staged = dl.TMA_OPTION in setup.options
            aligned = (num_keys + extra + (-num_keys) % 4) % 4 == 0
            pays = store_layout.contiguous_staging_pays(head_dim, *bits)
            assert staged == (tma and staged_available and aligned and pays), setup
            check(result, q, cache, c_k, c_v, bits=bits)
    dl.clear_caches()


def stored_as(head_dim, k_bits, v_bits, cache, capacity_extra):
    """The same codes and norms laid out as the contiguous store keeps them (store_layout.inline_norms): a side with
    inline norms as views of one uint8 buffer of rows ``codes | fp32 norm`` whose capacity (poisoned rows beyond N)
    is a multiple of 16 rows, so every (sequence, head) run starts 16-byte aligned."""
    sides = []
    for inline, (codes, norms) in zip(store_layout.inline_norms(head_dim, k_bits, v_bits), (cache[:2], cache[2:])):
        if not inline:
            sides += [codes, norms]
            continue
        capacity = -(-(codes.shape[2] + capacity_extra) // 16) * 16
        rows = torch.full((*codes.shape[:2], capacity, codes.shape[3] + 4), 0xFF, dtype=torch.uint8, device=DEV)
        rows = rows[:, :, : codes.shape[2]]
        rows.copy_(store_layout.joined_rows(codes, norms.contiguous()))
        sides += store_layout.split_rows(rows)
    return tuple(sides)


@pytest.mark.parametrize("head_dim, bits", [(128, (3, 3)), (128, (3, 2)), (128, (4, 3)), (128, (3, 4)),
                                            (128, (2, 3)), (64, (3, 3)), (64, (4, 3))])
@pytest.mark.parametrize("num_keys,group", [(1, 4), (97, 8), (1111, 4), (4133, 1)])
def test_tq_decode_norms_inline(head_dim, bits, num_keys, group, cuda_gen):
    """The store's layout with norms after their code rows (one run per such side in a staged tile on sm_90): the
    reference's result, staged by the build that reads that layout where tiles are staged."""
    import flashquant_hf.kernels.decode_launch as dl

    sides = store_layout.inline_norms(head_dim, *bits)
    assert any(sides)
    aligned = 16 - num_keys % 16  # a capacity of whole tiles: every (sequence, head) run of a side 16-byte aligned
    separate = random_cache(2, 2, num_keys, head_dim, aligned, seed=300 + num_keys, k_bits=bits[0], v_bits=bits[1])
    cache = stored_as(head_dim, *bits, separate, 19)
    assert dl.contiguous_runs(*cache) == sides
    q = torch.randn(2, 2 * group, 1, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check_widths(q, cache, *bits)
    staged = [launch.options for launch in dl._LAUNCHES.values() if dl.TMA_OPTION in launch.options]
    assert all(dl.INLINE_NORMS_OPTION in options for options in staged)
    if torch.cuda.get_device_capability()[0] == 9 and num_keys >= 16:
        assert staged, "sm_90 stages the inline layout's tiles"


def test_prepared_inline_call_does_not_serve_other_norms(cuda_gen):
    """A call prepared for norms that follow their rows is not reused for a call of the same shapes and strides whose
    norms live elsewhere: the staged build would read the rows' bytes as norms."""
    from flashquant_hf.kernels.tq_decode import tq_decode

    head_dim, bits, num_keys = 128, (3, 3), 2048
    ck, cv = centroids(head_dim, 3), centroids(head_dim, 3)
    separate = random_cache(2, 2, num_keys, head_dim, seed=7, k_bits=3, v_bits=3)
    inline = stored_as(head_dim, *bits, separate, 0)
    q = torch.randn(2, 8, 1, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    for _ in range(2):  # prepared, then served by the prepared call
        check(tq_decode(q, *inline, ck, cv, *bits, head_dim**-0.5), q, inline, ck, cv, bits)
    other_norms = []
    for norms in (inline[1], inline[3]):  # the same strides, other values, not after the rows
        buffer = torch.rand(*norms.shape[:2], norms.shape[2] * norms.stride(2), device=DEV, generator=cuda_gen) + 0.5
        other_norms.append(buffer[:, :, :: norms.stride(2)])
        assert other_norms[-1].stride() == norms.stride()
    mixed = (inline[0], other_norms[0], inline[2], other_norms[1])
    check(tq_decode(q, *mixed, ck, cv, *bits, head_dim**-0.5), q, mixed, ck, cv, bits)
