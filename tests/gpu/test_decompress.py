"""GPU tests of the decompress kernels (flashquant_hf.kernels.decompress) against the PyTorch reference.

``dequantize_rotated`` is one fp32 multiply per coordinate, so it must equal the reference bit for bit (after
the same round-to-nearest-even conversion for fp16/bf16 outputs). ``decompress``'s error against float64 math,
relative to each row's largest magnitude, must be at most twice the reference's own (PyTorch in the output dtype;
tests/tolerance.py), or one ulp of the output dtype, or for fp32 outputs one rounding per stage of the Hadamard
transform in each of the two. Output dtypes follow a Latin square over (head_dim, bits); every test
covers 1 row, odd row counts, and the cache's strided ``[:, :, :N]`` views of packed codes and norms.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tolerance import dtype_error_bound, max_error

from flashquant_hf import ops
from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.kernels import decompress as kd
from flashquant_hf.kernels import loader
from flashquant_hf.packing import packed_size, unpack_indices
from flashquant_hf.reference.compress import compress as reference_compress
from flashquant_hf.reference.decompress import decompress as reference_decompress
from flashquant_hf.reference.decompress import dequantize_rotated as reference_dequantize
from flashquant_hf.rotation import hadamard_signs, random_rotation

from .codec_helpers import CODEBOOK_AND_ROTATION_BAD_INPUTS

pytestmark = pytest.mark.usefixtures("exact_fp32_matmul")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GRID = [(d, b) for d in kd.HEAD_DIMS for b in kd.BITS]


def _dtype(i: int, head_dim: int, bits: int) -> torch.dtype:
    return DTYPES[(i + kd.HEAD_DIMS.index(head_dim) + kd.BITS.index(bits)) % 3]


ROTATED_CASES = [(d, b, _dtype(0, d, b)) for d, b in GRID] + [(128, 4, torch.bfloat16)]
HADAMARD_CASES = [(d, b, _dtype(1, d, b)) for d, b in GRID]
DENSE_CASES = [(d, b, _dtype(2, d, b)) for d, b in GRID]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """Compile every instantiation this module launches up front, in parallel (NVRTC releases the GIL)."""
    names = {kd.kernel_name("dequantize_rotated", d, b, t) for d, b, t in ROTATED_CASES}
    names |= {kd.kernel_name("decompress_hadamard", d, b, t) for d, b, t in HADAMARD_CASES}
    names |= {kd.kernel_name("dequantize_rotated", d, b, torch.float32) for d, b, _ in DENSE_CASES}
    device = torch.device("cuda", torch.cuda.current_device())
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda n: loader.get_kernel(kd.CUDA_SOURCE, n, device), sorted(names)))



def _codes(lead: tuple[int, ...], head_dim: int, bits: int, rotation: torch.Tensor, gen: torch.Generator, nc: bool):
    """Real codes of Gaussian vectors (reference compress), norms at mixed scales, the first vector zero."""
    x = torch.randn(lead + (head_dim,), generator=gen, device="cuda")
    x = x * 10.0 ** torch.randint(-2, 3, lead + (1,), generator=gen, device="cuda").float()
    x.view(-1, head_dim)[0] = 0
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    packed, norms = reference_compress(x, rotation, boundaries, bits, centroids, nc)
    return packed, norms, centroids


def _layouts(head_dim: int, bits: int, rotation: torch.Tensor, gen: torch.Generator, big: bool):
    """(label, packed, norms, centroids): contiguous and the cache's strided views."""
    out = []
    for label, lead in (("one row", (1,)), ("97 rows", (97,)), ("[3, 5, 7]", (3, 5, 7))):
        out.append((label,) + _codes(lead, head_dim, bits, rotation, gen, nc=len(lead) == 3))
    # The cache's layout: [B, H, N_cap, nbytes] buffers read as [:, :, :N].
    packed, norms, centroids = _codes((2, 4, 50), head_dim, bits, rotation, gen, nc=False)
    out.append(("cache view [2, 4, :37]", packed[:, :, :37], norms[:, :, :37], centroids))
    # Four non-collapsible leading dims (and odd byte strides for 3-bit codes): the wrapper copies.
    packed, norms, centroids = _codes((2, 3, 5, 7), head_dim, bits, rotation, gen, nc=False)
    out.append(("4 strided leading dims", packed.permute(3, 0, 2, 1, 4), norms.permute(3, 0, 2, 1), centroids))
    if big:  # several iterations of the persistent grid-stride loop
        out.append(("150001 rows",) + _codes((150001,), head_dim, bits, rotation, gen, nc=False))
    return out


def _launched(head_dim: int, bits: int, dtype: torch.dtype, rotation: torch.Tensor, signs: torch.Tensor | None,
              gen: torch.Generator, poison):
    """(label, packed, norms, centroids, out) of every layout, ``out`` poisoned and then written by
    ``launch_decompress``: ``dequantize_rotated`` when ``signs`` is None, else the Hadamard ``decompress``."""
    for label, packed, norms, centroids in _layouts(head_dim, bits, rotation, gen, big=head_dim == 128):
        out = poison(torch.empty(packed.shape[:-1] + (head_dim,), dtype=dtype, device="cuda"))
        kd.launch_decompress(packed, norms, centroids, bits, signs, out)
        yield label, packed, norms, centroids, out


def _close_problems(label: str, got: torch.Tensor, packed, norms, rotation, centroids, bits, head_dim,
                    dtype) -> list[str]:
    """How ``got`` misses the reference decompression (empty when it is close enough)."""
    if got.shape != packed.shape[:-1] + (head_dim,) or got.dtype != dtype:
        return [f"{label}: output is {got.dtype} {list(got.shape)}"]
    if not torch.isfinite(got).all():
        return [f"{label}: {int((~torch.isfinite(got)).sum())} non-finite outputs (poison left?)"]
    want = reference_decompress(packed, norms, rotation, centroids, bits, head_dim, dtype)
    idx = unpack_indices(packed, bits, head_dim)
    truth = (centroids.double()[idx] * norms.double().unsqueeze(-1)) @ rotation.double()
    scale = truth.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    # One ulp of the output, or for fp32 outputs one rounding at the row maximum per butterfly stage of the
    # kernel's Hadamard transform and as many in the reference's GEMM.
    floor = max(torch.finfo(dtype).eps, 2 * math.log2(head_dim) * torch.finfo(torch.float32).eps)
    error = max_error(got.double() / scale, truth / scale)
    bound = dtype_error_bound(want.double() / scale, truth / scale, dtype, floor=floor)
    if error > bound:
        return [f"{label}: error {error:.3g} relative to the row maximum, over {bound:.3g} (2x the reference's)"]
    return []


def _check_close(label: str, got: torch.Tensor, packed, norms, rotation, centroids, bits, head_dim, dtype):
    problems = _close_problems(label, got, packed, norms, rotation, centroids, bits, head_dim, dtype)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("head_dim,bits,dtype", ROTATED_CASES)
def test_dequantize_rotated_is_exact(head_dim, bits, dtype, poison, rng_seed, cuda_gen):
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation = random_rotation(head_dim, seed % 1000, device="cuda")
    problems = []
    for label, packed, norms, centroids, out in _launched(head_dim, bits, dtype, rotation, None, gen, poison):
        label = f"D={head_dim} bits={bits} {dtype} {label} seed={seed}"
        want = reference_dequantize(packed, norms, centroids, bits, head_dim).to(dtype)
        if not torch.equal(out, want):
            wrong = (out != want) | torch.isnan(out)
            first = wrong.nonzero()[:3].tolist()
            problems.append(f"{label}: {int(wrong.sum())} of {out.numel()} values differ; first at {first}: "
                            f"{[out[tuple(i)].item() for i in first]} vs {[want[tuple(i)].item() for i in first]}")
            continue
        public = kd.dequantize_rotated(packed, norms, centroids, bits, head_dim, dtype)
        if not (torch.equal(public, want) and public.is_contiguous()):
            problems.append(f"{label}: the public function differs from the launch")
    assert not problems, f"{len(problems)} failing layouts:\n" + "\n".join(problems[:8])


@pytest.mark.parametrize("head_dim,bits,dtype", HADAMARD_CASES)
def test_decompress_hadamard_matches_reference(head_dim, bits, dtype, poison, rng_seed, cuda_gen):
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation = random_rotation(head_dim, seed % 1000, "hadamard", device="cuda")
    signs = hadamard_signs(head_dim, seed % 1000, device="cuda")
    problems = []
    for label, packed, norms, centroids, out in _launched(head_dim, bits, dtype, rotation, signs, gen, poison):
        label = f"hadamard D={head_dim} bits={bits} {dtype} {label} seed={seed}"
        problems += _close_problems(label, out, packed, norms, rotation, centroids, bits, head_dim, dtype)
        public = kd.decompress(packed, norms, rotation, centroids, bits, head_dim, dtype, signs)
        if not torch.equal(public, out):
            problems.append(f"{label}: the public function differs from the launch")
    assert not problems, f"{len(problems)} failing layouts:\n" + "\n".join(problems[:8])


@pytest.mark.parametrize("head_dim,bits,dtype", DENSE_CASES)
def test_decompress_dense_matches_reference(head_dim, bits, dtype, rng_seed, cuda_gen):
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation = random_rotation(head_dim, seed % 1000, device="cuda")
    problems = []
    for label, packed, norms, centroids in _layouts(head_dim, bits, rotation, gen, big=False):
        label = f"haar D={head_dim} bits={bits} {dtype} {label} seed={seed}"
        got = kd.decompress(packed, norms, rotation, centroids, bits, head_dim, dtype)
        problems += _close_problems(label, got, packed, norms, rotation, centroids, bits, head_dim, dtype)
    assert not problems, f"{len(problems)} failing layouts:\n" + "\n".join(problems[:8])


def test_dense_decompress_ignores_tf32_setting():
    """With TF32 switched on by the caller, the fp32 GEMM still runs in fp32 and the setting survives."""
    head_dim, bits = 128, 4
    rotation = random_rotation(head_dim, 3, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    packed, norms, centroids = _codes((4096,), head_dim, bits, rotation, gen, nc=False)
    torch.backends.cuda.matmul.allow_tf32 = True
    got = kd.decompress(packed, norms, rotation, centroids, bits, head_dim)
    assert torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_close("tf32 on", got, packed, norms, rotation, centroids, bits, head_dim, torch.float32)


def test_unsupported_sizes_run_the_reference_through_ops():
    """head_dim 96 has no kernel: the wrappers refuse it with the reason, and ops on the "cuda" backend return the
    reference's results on the GPU."""
    rotation = random_rotation(96, 0, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    packed, norms, centroids = _codes((5,), 96, 4, rotation, gen, nc=False)
    assert kd.unsupported(96, 4) is not None and kd.unsupported(128, 4) is None
    with pytest.raises(ValueError, match="head_dim=96"):
        kd.decompress(packed, norms, rotation, centroids, 4, 96, torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim=96"):
        kd.dequantize_rotated(packed, norms, centroids, 4, 96)
    got = ops.decompress(packed, norms, rotation, centroids, 4, 96, torch.bfloat16, backend="cuda")
    assert torch.equal(got, reference_decompress(packed, norms, rotation, centroids, 4, 96, torch.bfloat16))
    got = ops.dequantize_rotated(packed, norms, centroids, 4, 96, backend="cuda")
    assert torch.equal(got, reference_dequantize(packed, norms, centroids, 4, 96))


def test_empty_input_gives_empty_output():
    rotation = random_rotation(128, 0, "hadamard", device="cuda")
    centroids, _ = lloyd_max_codebook(128, 4).tensors("cuda")
    packed = torch.empty(2, 0, 64, dtype=torch.uint8, device="cuda")
    norms = torch.empty(2, 0, device="cuda")
    assert kd.decompress(packed, norms, rotation, centroids, 4, 128, torch.bfloat16).shape == (2, 0, 128)
    assert kd.dequantize_rotated(packed, norms, centroids, 4, 128).shape == (2, 0, 128)


def _good_args(**overrides):
    head_dim, bits = 128, 4
    centroids, _ = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    args = dict(
        packed=torch.zeros(3, packed_size(head_dim, bits), dtype=torch.uint8, device="cuda"),
        norms=torch.ones(3, device="cuda"),
        rotation=random_rotation(head_dim, 0, device="cuda"),
        centroids=centroids,
        bits=bits,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    args.update(overrides)
    return args


# Factories, not tensors: collection must not touch CUDA on machines without a GPU.
BAD_INPUTS = [
    (lambda: dict(packed=torch.zeros(3, 64, dtype=torch.uint8)), ValueError, r"`packed` must be a CUDA tensor.*cpu"),
    (lambda: dict(packed=torch.zeros(3, 64, device="cuda")), ValueError, r"`packed` must have dtype uint8"),
    (lambda: dict(packed=torch.zeros(3, 48, dtype=torch.uint8, device="cuda")), ValueError,
     r"`packed` must have shape \[\.\.\., 64\]"),
    (lambda: dict(norms=torch.ones(4, device="cuda")), ValueError, r"`norms` must have shape \[3\]"),
    (lambda: dict(norms=torch.ones(3, device="cuda", dtype=torch.float16)), ValueError,
     r"`norms` must have dtype float32"),
    (lambda: dict(norms=torch.ones(3)), ValueError, r"`norms` must be a CUDA tensor.*cpu"),
    (lambda: dict(dtype=torch.int8), ValueError, r"`dtype` must be one of"),
] + CODEBOOK_AND_ROTATION_BAD_INPUTS


@pytest.mark.parametrize("overrides,error,match", BAD_INPUTS)
def test_bad_inputs_raise(overrides, error, match):
    with pytest.raises(error, match=match):
        kd.decompress(**_good_args(**overrides()))
