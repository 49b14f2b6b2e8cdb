"""CUDA FlashAttention-2 forward vs float64 attention on the same inputs: errors within 2x those of PyTorch's
attention in the same dtype (tests/tolerance.py)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from attention_helpers import attention_in_dtype
from tolerance import assert_attention_within_dtype_error, assert_within_dtype_error

from flashquant_hf.kernels import flash_attention as fa
from flashquant_hf.kernels import loader
from flashquant_hf.reference.flash_attention import flash_attention as reference

DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """Compile every instantiation this module launches up front, in parallel (NVRTC releases the GIL)."""
    names = {fa.name_expression(d, t, fa.DEFAULT_CONFIGS[d]) for d in fa.HEAD_DIMS for t in fa.DTYPES}
    names |= {fa.name_expression(128, torch.bfloat16, c) for c in fa.CANDIDATE_CONFIGS[128]}
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda n: loader.get_kernel(fa.CUDA_SOURCE, n, device), sorted(names)))
    except Exception as error:  # noqa: BLE001 - the tests compile lazily instead and report the real error
        print(f"parallel precompile failed: {error!r}")


def make_inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, seed, strided=True, magnitude=1.0):
    """Random q [B, Hq, Lq, D] (a transposed view when ``strided``) and k, v [B, H_kv, N, D] (views into a
    larger capacity buffer when ``strided``, as the HF cache passes them)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    if strided:
        q = torch.randn(batch, q_len, q_heads, head_dim, generator=gen, device=DEV).transpose(1, 2)
        cap = kv_len + 19
    else:
        q = torch.randn(batch, q_heads, q_len, head_dim, generator=gen, device=DEV)
        cap = kv_len
    k = torch.randn(batch, kv_heads, cap, head_dim, generator=gen, device=DEV)[:, :, :kv_len]
    v = torch.randn(batch, kv_heads, cap, head_dim, generator=gen, device=DEV)[:, :, :kv_len]
    return (q * magnitude).to(dtype), k.to(dtype), v.to(dtype)


def run_poisoned(config, q, k, v, scale, causal):
    """Launch into NaN-filled outputs so an unwritten element cannot pass."""
    batch, q_heads, q_len, head_dim = q.shape
    out = torch.full((batch, q_heads, q_len, head_dim), float("nan"), dtype=q.dtype, device=DEV)
    lse = torch.full((batch, q_heads, q_len), float("nan"), dtype=torch.float32, device=DEV)
    fa.launch_flash_attention(q, k, v, scale, causal, out, lse, config)
    torch.cuda.synchronize()
    return out, lse


def assert_matches(out, lse, q, k, v, scale, causal, label=""):
    exact = reference(q.double(), k.double(), v.double(), scale, causal)
    in_dtype = attention_in_dtype(q, k, v, scale, dtype=q.dtype, causal=causal)
    assert_attention_within_dtype_error((out, lse), exact, in_dtype, q.dtype, label)


CASES = [
    # (B, Hq, H_kv, Lq, N, causal)
    (1, 1, 1, 1, 1, False),        # one key, one query
    (2, 4, 4, 37, 97, True),       # lengths not multiples of the tiles
    (1, 8, 2, 130, 300, True),     # GQA 4, offset diagonal (Lq < N)
    (1, 8, 1, 64, 64, False),      # GQA 8
    (2, 2, 1, 200, 77, True),      # Lq > N: the first rows see no key
    (1, 4, 4, 1, 500, True),       # one query over many keys
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", fa.HEAD_DIMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_H{}x{}_L{}_N{}_{}".format(*c[:5],
                                                                                   "causal" if c[5] else "full"))
def test_matches_float64(dtype, head_dim, case):
    batch, q_heads, kv_heads, q_len, kv_len, causal = case
    q, k, v = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype,
                          seed=sum(map(ord, repr(case))) + head_dim)
    scale = head_dim ** -0.5
    out, lse = run_poisoned(fa.DEFAULT_CONFIGS[head_dim], q, k, v, scale, causal)
    assert_matches(out, lse, q, k, v, scale, causal, f"{dtype} D={head_dim} {case}")


@pytest.mark.parametrize("config", fa.CANDIDATE_CONFIGS[128], ids=lambda c: c.label())
@pytest.mark.parametrize("case", [(2, 8, 2, 333, 333, True), (1, 4, 4, 100, 257, False), (1, 8, 8, 3, 1000, True)])
def test_every_candidate_tiling(config, case):
    batch, q_heads, kv_heads, q_len, kv_len, causal = case
    q, k, v = make_inputs(batch, q_heads, kv_heads, q_len, kv_len, 128, torch.bfloat16, seed=7)
    out, lse = run_poisoned(config, q, k, v, 128 ** -0.5, causal)
    assert_matches(out, lse, q, k, v, 128 ** -0.5, causal, f"{config.label()} {case}")


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    rnd = random.Random(seed)
    head_dim = rnd.choice(fa.HEAD_DIMS)
    kv_heads = rnd.choice([1, 2, 4])
    group = rnd.choice([1, 4, 8])
    q_len, kv_len = rnd.randint(1, 300), rnd.randint(1, 700)
    causal = rnd.random() < 0.6
    dtype = rnd.choice([torch.float16, torch.bfloat16])
    q, k, v = make_inputs(rnd.randint(1, 3), kv_heads * group, kv_heads, q_len, kv_len, head_dim, dtype, seed,
                          strided=rnd.random() < 0.5)
    out, lse = fa.flash_attention(q, k, v, head_dim ** -0.5, causal)
    assert out.is_contiguous() and out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(out, lse, q, k, v, head_dim ** -0.5, causal, f"seed {seed}")


def test_large_scores_stay_finite():
    """Sharp softmax (scores ~ +-60): the running max must keep exp2 in range."""
    q, k, v = make_inputs(1, 4, 2, 150, 400, 128, torch.bfloat16, seed=3, magnitude=6.0)
    out, lse = fa.flash_attention(q, k, v, 128 ** -0.5, causal=True)
    assert_matches(out, lse, q, k, v, 128 ** -0.5, True, "large scores")


def test_misaligned_view_is_copied(cuda_gen):
    """A view whose rows are not 16-byte aligned still gives the right answer (through a compact copy)."""
    base = torch.randn(1, 2, 65, 128 + 1, device=DEV, dtype=torch.float16, generator=cuda_gen)
    k = base[:, :, :64, 1:]
    q, _, v = make_inputs(1, 2, 2, 64, 64, 128, torch.float16, seed=5, strided=False)
    out, lse = fa.flash_attention(q, k, v, 0.1, causal=False)
    assert_matches(out, lse, q, k, v, 0.1, False, "misaligned k")


def test_error_within_twice_sdpas():
    """PyTorch's own bf16 attention (SDPA) as the other side of the bound, same shape as the benchmark but small."""
    q, k, v = make_inputs(2, 8, 8, 256, 256, 128, torch.bfloat16, seed=11, strided=False)
    out, _ = fa.flash_attention(q, k, v, 128 ** -0.5, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact, _ = reference(q.double(), k.double(), v.double(), 128 ** -0.5, True)
    assert_within_dtype_error(out, exact, sdpa, torch.bfloat16, "out")


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: (q.float(), k, v), TypeError, "float16 or bfloat16"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share a dtype"),
        (lambda q, k, v: (q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous()), ValueError,
         "head_dim"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of the KV heads"),
        (lambda q, k, v: (q, k[:, :, :5], v), ValueError, r"\[B, H_kv, N, D\]"),
        (lambda q, k, v: (q.cpu(), k, v), ValueError, "CUDA device"),
        (lambda q, k, v: (q[0], k, v), ValueError, "4 dimensions"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    q, k, v = make_inputs(1, 4, 2, 8, 8, 128, torch.bfloat16, seed=0, strided=False)
    with pytest.raises(error, match=match):
        fa.flash_attention(*change(q, k, v), 0.1)


def test_invalid_scale_raises():
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, torch.bfloat16, seed=0, strided=False)
    with pytest.raises(ValueError, match="scale"):
        fa.flash_attention(q, k, v, -1.0)
