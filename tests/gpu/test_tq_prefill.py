"""CUDA fused TurboQuant prefill attention vs float64 attention on the same decompressed inputs: errors within 2x
those of PyTorch's bf16 attention over them (tests/tolerance.py; the kernel rounds queries and centroids to bf16)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from attention_helpers import attention_in_dtype
from tolerance import assert_attention_within_dtype_error, score_rounding_floor, ulp_floor

from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.kernels import loader, merge_partials
from flashquant_hf.kernels import tq_prefill as tqp
from flashquant_hf.reference.decompress import dequantize_rotated
from flashquant_hf.reference.tq_attention import tq_attention as reference

DEV = "cuda"


def make_inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, k_bits, v_bits, seed, q_dtype=torch.bfloat16,
                bias="none"):
    """Random rotated queries and a compressed cache: packed bytes / norms are views ``[:, :, :N]`` of a larger
    capacity buffer. Keys are scaled so that scores have unit-order spread."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cap = kv_len + 23

    def packed(bits):
        nbytes = tqp.packed_bytes(head_dim, bits)
        return torch.randint(0, 256, (batch, kv_heads, cap, nbytes), generator=gen, device=DEV,
                             dtype=torch.uint8)[:, :, :kv_len]

    def norms(lo, hi):
        return (lo + (hi - lo) * torch.rand(batch, kv_heads, cap, generator=gen, device=DEV))[:, :, :kv_len]

    q_rot = torch.randn(batch, q_heads, q_len, head_dim, generator=gen, device=DEV).to(q_dtype)
    k_c = lloyd_max_codebook(head_dim, k_bits).tensors(DEV)[0]
    v_c = lloyd_max_codebook(head_dim, v_bits).tensors(DEV)[0]
    key_bias = None
    if bias != "none":
        pad = torch.rand(batch, kv_len, generator=gen, device=DEV) < 0.3
        key_bias = torch.where(pad, float("-inf"), 0.0)
        if bias == "alibi":
            key_bias = key_bias - 0.01 * torch.arange(kv_len, device=DEV).flip(0)
        if batch > 1:
            key_bias[0] = float("-inf")  # a sequence whose keys are all padding
    return dict(q_rot=q_rot, k_packed=packed(k_bits), k_norms=norms(0.5, 1.5) * head_dim ** 0.5 * 0.8,
                v_packed=packed(v_bits), v_norms=norms(0.2, 2.0), k_centroids=k_c, v_centroids=v_c,
                k_bits=k_bits, v_bits=v_bits, scale=head_dim ** -0.5, key_bias=key_bias)


CLUSTER_CONFIGS = [c for c in tqp.CANDIDATE_CONFIGS[128] if 1 <= c.cluster <= 4]
CLUSTER_BITS = [(4, 4), (3, 3), (2, 3), (4, 2)]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """Compile every instantiation this module launches up front, in parallel (NVRTC releases the GIL)."""
    names = {tqp.name_expression(d, kb, vb, tqp.DEFAULT_CONFIGS[d]) for d, pairs in BITS.items() for kb, vb in pairs}
    names |= {tqp.name_expression(128, 4, 4, c) for c in tqp.CANDIDATE_CONFIGS[128]}
    names |= {tqp.name_expression(128, kb, vb, c) for c in CLUSTER_CONFIGS for kb, vb in CLUSTER_BITS + BITS[128]}
    names |= {tqp.name_expression(128, kb, vb, tqp.fallback_config(128)) for kb, vb in BITS[128]}
    kernels = [(tqp.CUDA_SOURCE, n) for n in sorted(names)]
    kernels += [(merge_partials.CUDA_SOURCE, merge_partials.merge_name(d)) for d in tqp.HEAD_DIMS]  # the split merge
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda k: loader.get_kernel(*k, device), kernels))
    except Exception as error:  # noqa: BLE001 - the tests compile lazily instead and report the real error
        print(f"parallel precompile failed: {error!r}")


def run_poisoned(config, splits, causal, inp):
    """Launch into NaN-filled partial buffers, then merge like the wrapper does."""
    batch, q_heads, q_len, head_dim = inp["q_rot"].shape
    out = torch.full((splits, batch, q_heads, q_len, head_dim), float("nan"), device=DEV)
    lse = torch.full((splits, batch, q_heads, q_len), float("nan"), device=DEV)
    tqp.launch_tq_prefill(**{k: v for k, v in inp.items()}, causal=causal, out=out, lse=lse, config=config,
                          splits=splits)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten partial output"
    if splits == 1:
        return out[0], lse[0]
    from flashquant_hf.reference.merge_partials import merge_partials as reference_merge
    return reference_merge(out, lse)


def assert_matches(out, lse, inp, causal, label=""):
    # The kernel documents its bf16 query conversion: the oracle gets the same bf16 values in float64.
    q_rot = inp["q_rot"].to(torch.bfloat16)
    exact = reference(**dict(inp, q_rot=q_rot.double()), causal=causal)
    head_dim = q_rot.shape[-1]
    keys = dequantize_rotated(inp["k_packed"], inp["k_norms"], inp["k_centroids"], inp["k_bits"], head_dim)
    values = dequantize_rotated(inp["v_packed"], inp["v_norms"], inp["v_centroids"], inp["v_bits"], head_dim)
    bias = None if inp["key_bias"] is None else inp["key_bias"][:, None, None, :]
    in_dtype = attention_in_dtype(q_rot, keys, values, inp["scale"], bias, torch.bfloat16, causal=causal)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    lse_floor = max(ulp_floor(exact[1], torch.bfloat16, torch.isfinite(exact[1])),
                    score_rounding_floor(q_rot, keys.repeat_interleave(q_rot.shape[1] // keys.shape[1], dim=1), inp["scale"], torch.bfloat16))
    assert_attention_within_dtype_error((out, lse), exact, in_dtype, torch.bfloat16, label, lse_floor=lse_floor)


CASES = [
    # (B, Hq, H_kv, Lq, N, causal, bias)
    (1, 1, 1, 1, 1, False, "none"),       # one key, one query
    (2, 8, 2, 37, 300, True, "none"),     # GQA 4, tiles not full, offset diagonal
    (1, 4, 4, 130, 97, True, "pad"),      # Lq > N: first rows see nothing; padding bias
    (2, 8, 1, 16, 1000, True, "alibi"),   # GQA 8, a batch row fully padded, general additive bias
    (1, 2, 1, 64, 64, False, "none"),
]


def case_id(case) -> str:
    return "B{}_H{}x{}_L{}_N{}_{}_{}".format(*case[:5], "causal" if case[5] else "full", case[6])


BITS = {
    128: [(4, 4), (2, 2), (3, 3), (4, 2), (2, 3)],
    64: [(4, 4), (3, 3)],
    256: [(4, 4), (3, 2)],
}


@pytest.mark.parametrize("head_dim, k_bits, v_bits", [(d, kb, vb) for d, pairs in BITS.items() for kb, vb in pairs])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_float64(head_dim, k_bits, v_bits, case):
    batch, q_heads, kv_heads, q_len, kv_len, causal, bias = case
    inp = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, k_bits, v_bits,
                      seed=sum(map(ord, repr(case))) + head_dim + k_bits, bias=bias)
    out, lse = run_poisoned(tqp.DEFAULT_CONFIGS[head_dim], 1, causal, inp)
    assert_matches(out, lse, inp, causal, f"D={head_dim} k{k_bits}v{v_bits} {case}")


FULL_MATRIX_CONFIGS = [tqp.fallback_config(128)] + [c for c in CLUSTER_CONFIGS if c != tqp.DEFAULT_CONFIGS[128]]


@pytest.mark.parametrize("config", FULL_MATRIX_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("k_bits, v_bits", BITS[128], ids=lambda b: str(b))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_other_d128_configs_full_matrix(config, k_bits, v_bits, case):
    """The default test matrix at D = 128 on the fallback below sm_90 and the other cluster variant too."""
    batch, q_heads, kv_heads, q_len, kv_len, causal, bias = case
    inp = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, 128, k_bits, v_bits,
                      seed=sum(map(ord, repr(case))) + k_bits, bias=bias)
    out, lse = run_poisoned(config, 1, causal, inp)
    assert_matches(out, lse, inp, causal, f"{config.label()} k{k_bits}v{v_bits} {case}")


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_keys_merge(splits):
    inp = make_inputs(2, 8, 2, 45, 900, 128, 4, 4, seed=splits, bias="pad")
    out, lse = run_poisoned(tqp.DEFAULT_CONFIGS[128], splits, True, inp)
    assert_matches(out, lse, inp, True, f"splits={splits}")


def test_repeated_signature_reuses_the_launch_plan():
    """A second call with the same shapes, strides and settings takes the cached launch path: fresh data, poisoned
    outputs, still the right answer."""
    config = tqp.DEFAULT_CONFIGS[128]
    for seed in (31, 32):
        inp = make_inputs(1, 8, 2, 70, 500, 128, 4, 4, seed=seed, bias="pad")
        out, lse = run_poisoned(config, 2, True, inp)
        assert_matches(out, lse, inp, True, f"plan reuse seed {seed}")
    out, lse = tqp.tq_prefill(**inp, causal=True)
    out2, lse2 = tqp.tq_prefill(**inp, causal=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_public_path_with_forced_splits():
    """tq_prefill_with(splits=...) merges through the kernel."""
    inp = make_inputs(2, 8, 2, 45, 900, 128, 4, 4, seed=12, bias="pad")
    out, lse = tqp.tq_prefill_with(tqp.DEFAULT_CONFIGS[128], **inp, causal=True, splits=3)
    assert_matches(out, lse, inp, True, "public splits=3")


@pytest.mark.parametrize("config", tqp.CANDIDATE_CONFIGS[128], ids=lambda c: c.label())
@pytest.mark.parametrize("case", [(1, 32, 8, 100, 700, True), (2, 4, 4, 3, 257, False)])
def test_every_candidate_tiling(config, case):
    batch, q_heads, kv_heads, q_len, kv_len, causal = case
    inp = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, 128, 4, 4, seed=21)
    out, lse = run_poisoned(config, 2, causal, inp)
    assert_matches(out, lse, inp, causal, f"{config.label()} {case}")


CLUSTER_CASES = [
    # (B, Hq, H_kv, Lq, N, causal, bias, splits)
    (2, 8, 2, 37, 300, True, "none", 1),      # one row block: the rest of the cluster owns no rows
    (1, 4, 4, 130, 97, True, "pad", 1),       # Lq > N: first rows see nothing
    (2, 8, 1, 16, 1000, True, "alibi", 3),    # GQA 8, a fully padded sequence, key splits
    (1, 8, 2, 600, 2000, True, "none", 2),    # 10 row blocks: causal ranges differ inside a cluster
    (1, 2, 1, 64, 64, False, "none", 1),
]


@pytest.mark.parametrize("config", CLUSTER_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize(
    "bits, case",
    [((4, 4), c) for c in CLUSTER_CASES] + [(b, c) for b in CLUSTER_BITS[1:] for c in CLUSTER_CASES[2:4]],
    ids=lambda x: "k{}v{}".format(*x) if len(x) == 2 else "B{}_H{}x{}_L{}_N{}_{}_{}_s{}".format(
        *x[:5], "causal" if x[5] else "full", *x[6:]),
)
def test_cluster_kernel(config, bits, case):
    """Thread-block clusters: each CTA decodes a slice of every key tile for the whole cluster (DSMEM)."""
    batch, q_heads, kv_heads, q_len, kv_len, causal, bias, splits = case
    inp = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, 128, *bits, seed=kv_len + q_len + bits[0], bias=bias)
    out, lse = run_poisoned(config, splits, causal, inp)
    assert_matches(out, lse, inp, causal, f"{config.label()} k{bits[0]}v{bits[1]} {case}")


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_public_function_query_dtypes(q_dtype):
    """Through the public entry point: automatic split count, fp16/bf16/fp32 queries."""
    inp = make_inputs(1, 32, 8, 200, 3000, 128, 4, 4, seed=4, q_dtype=q_dtype)
    out, lse = tqp.tq_prefill(**inp, causal=True)
    assert out.shape == inp["q_rot"].shape and lse.shape == inp["q_rot"].shape[:3]
    assert_matches(out, lse, inp, True, f"public {q_dtype}")


def test_unaligned_packed_rows_are_read(cuda_gen):
    """TQ3 rows of 24 bytes in a buffer with an odd row stride: no 4-byte alignment, so the wrapper copies."""
    inp = make_inputs(1, 2, 1, 20, 150, 64, 3, 3, seed=8)
    wide = torch.randint(0, 256, (1, 1, 150, 25), device=DEV, dtype=torch.uint8, generator=cuda_gen)
    inp["k_packed"] = wide[..., :24]
    out, lse = tqp.tq_prefill(**inp, causal=True)
    assert_matches(out, lse, inp, True, "odd row stride")


def test_dispatch_through_tq_attention():
    from flashquant_hf.kernels.tq_attention import tq_attention

    inp = make_inputs(1, 4, 2, 33, 200, 64, 4, 4, seed=9)
    out, lse = tq_attention(**inp, causal=True)
    assert_matches(out, lse, inp, True, "kernels.tq_attention")


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("k_bits", 1, ValueError, "k_bits"),
        ("q_rot", "x", TypeError, "q_rot"),
        ("k_norms", "half", ValueError, "k_norms"),
        ("v_packed", "short", ValueError, "v_packed"),
        ("k_centroids", "wrong_len", ValueError, "k_centroids"),
        ("key_bias", "wrong_len", ValueError, "key_bias"),
        ("scale", 0.0, ValueError, "scale"),
    ],
)
def test_invalid_inputs_raise(field, value, error, match):
    inp = make_inputs(1, 4, 2, 8, 40, 128, 4, 4, seed=0)
    tqp.tq_prefill(**inp)  # the valid signature is cached first: the invalid one must still be checked
    if value == "half":
        value = inp[field].half()
    elif value == "short":
        value = inp[field][:, :, :10]
    elif value == "wrong_len":
        value = torch.zeros(3, device=DEV) if field == "k_centroids" else torch.zeros(1, 39, device=DEV)
    inp[field] = value
    with pytest.raises(error, match=match):
        tqp.tq_prefill(**inp)


def test_fast_launch_matches_cupy_launch(monkeypatch):
    """The cached cuLaunchKernel path (kernel and split merge) and CuPy's launch give identical bits, and the
    kernel's reused parameter array follows changing pointers, lengths, splits, bias and query dtypes."""
    config = tqp.DEFAULT_CONFIGS[128]
    cases = [  # (B, Hq, H_kv, Lq, N, bias, splits, q dtype)
        (1, 8, 2, 70, 500, "pad", 2, torch.bfloat16),
        (1, 8, 2, 70, 500, "none", 2, torch.bfloat16),  # same kernel, NULL bias pointer
        (2, 8, 2, 45, 900, "pad", 1, torch.float16),     # converted queries
        (1, 8, 2, 70, 501, "pad", None, torch.bfloat16),
        (1, 8, 2, 70, 500, "pad", 2, torch.bfloat16),   # the first signature again, fresh tensors
    ]
    for i, (batch, q_heads, kv_heads, q_len, kv_len, bias, splits, dtype) in enumerate(cases):
        inp = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, 128, 4, 4, seed=50 + i, q_dtype=dtype, bias=bias)
        results = []
        for fast in (True, False):
            monkeypatch.setattr(tqp, "FAST_LAUNCH", fast)
            results.append(tqp.tq_prefill_with(config, **inp, causal=True, splits=splits))
        (fast_out, fast_lse), (slow_out, slow_lse) = results
        assert torch.equal(fast_out, slow_out) and torch.equal(fast_lse, slow_lse), f"case {i}"
        assert_matches(fast_out, fast_lse, inp, True, f"fast launch case {i}")
