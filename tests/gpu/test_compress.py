"""GPU tests of the fused compress kernel (flashquant_hf.kernels.compress) against the PyTorch reference.

Indices must equal the reference's except where the exact (float64) rotated coordinate lies within 1e-6 of a
boundary; norms must be within 2x the error of PyTorch's fp32 norms against float64 (tests/tolerance.py). Each
(rotation path, head_dim, bits) instantiation runs once, with the input dtype chosen by a Latin square so that every
dtype meets every head_dim and bit width; within a test the shapes cover 1 row, row counts that are not multiples
of the rows per CTA, strided views, a view that needs a copy, a zero row, and (for D=128) enough rows for several
iterations of the persistent loop.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tolerance import dtype_error_bound, max_error

from flashquant_hf import custom_ops  # noqa: F401  (registers torch.ops.flashquant)
from flashquant_hf import ops
from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.kernels import compress as kc
from flashquant_hf.kernels import loader
from flashquant_hf.packing import packed_size, unpack_indices
from flashquant_hf.reference.compress import compress as reference_compress
from flashquant_hf.reference.compress import compress_into as reference_compress_into
from flashquant_hf.rotation import hadamard_signs, random_rotation

from .codec_helpers import CODEBOOK_AND_ROTATION_BAD_INPUTS

pytestmark = pytest.mark.usefixtures("exact_fp32_matmul")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TINY = torch.finfo(torch.float32).tiny
NEAR = 1e-6  # indices may differ only this close to a boundary


def _cases() -> list[tuple[str, int, int, torch.dtype]]:
    cases = []
    for ip, path in enumerate(kc.ROTATION_PATHS):
        for i_d, head_dim in enumerate(kc.HEAD_DIMS):
            for i_b, bits in enumerate(kc.BITS):
                cases.append((path, head_dim, bits, DTYPES[(ip + i_d + i_b) % 3]))
    # The benchmark's configuration on both paths.
    for path in kc.ROTATION_PATHS:
        if (path, 128, 4, torch.bfloat16) not in cases:
            cases.append((path, 128, 4, torch.bfloat16))
    # Every (head_dim, bits) of the tensor-core Hadamard kernel with a 16-bit dtype.
    for head_dim in (64, 128):
        for bits in kc.BITS:
            if not any(c[:3] == ("hadamard", head_dim, bits) and c[3] != torch.float32 for c in cases):
                cases.append(("hadamard", head_dim, bits, DTYPES[bits % 2]))
    return cases


CASES = _cases()


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """Compile every instantiation this module launches up front, in parallel (NVRTC releases the GIL)."""
    names = sorted({kc.kernel_name(p, d, b, t) for p, d, b, t in CASES})
    device = torch.device("cuda", torch.cuda.current_device())
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda name: loader.get_kernel(kc.CUDA_SOURCE, name, device), names))



def _rotation(path: str, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    kind = "hadamard" if path == "hadamard" else "haar"
    rotation = random_rotation(head_dim, seed, kind, device="cuda")
    signs = hadamard_signs(head_dim, seed, device="cuda") if path == "hadamard" else None
    return rotation, signs


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gaussian rows at mixed scales, the first row zero."""
    x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
    scale = 10.0 ** torch.randint(-2, 3, shape[:-1] + (1,), generator=gen, device="cuda").float()
    x = (x * scale).to(dtype)
    x.view(-1, shape[-1])[0] = 0
    return x


def _views(head_dim: int, dtype: torch.dtype, gen: torch.Generator, big: bool) -> list[tuple[str, torch.Tensor]]:
    d = head_dim
    views = [
        ("one row", _inputs((1, d), dtype, gen)),
        ("97 rows", _inputs((97, d), dtype, gen)),
        ("[3, 5, 7] rows", _inputs((3, 5, 7, d), dtype, gen)),
        # HF's key/value layout: [B, L, H, D] transposed to [B, H, L, D]: three strided leading dims.
        ("transposed [2, 4, 37]", _inputs((2, 37, 4, d), dtype, gen).transpose(1, 2)),
        # A slice of a wider last dim keeps 16-byte aligned rows: strided, no copy.
        ("sliced last dim", _inputs((41, d + 64), dtype, gen)[:, 32 : 32 + d]),
        # Misaligned rows and four non-collapsible leading dims: the wrapper copies.
        ("misaligned rows", _inputs((29, d + 1), dtype, gen)[:, 1:]),
        ("4 strided leading dims", _inputs((2, 3, 5, 7, d), dtype, gen).permute(3, 0, 2, 1, 4)),
    ]
    if big:  # several iterations of the persistent grid-stride loop
        views.append(("150001 rows", _inputs((150001, d), dtype, gen)))
    return views


def _near_boundary(x: torch.Tensor, rotation: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    unit = x64 / x64.norm(dim=-1, keepdim=True).clamp_min(TINY)
    y = unit @ rotation.double().T
    return (y.unsqueeze(-1) - boundaries.double()).abs().amin(-1) < NEAR


def _launch(x, rotation, boundaries, bits, centroids, nc, signs, poison):
    d = x.shape[-1]
    packed = poison(torch.empty(x.shape[:-1] + (packed_size(d, bits),), dtype=torch.uint8, device="cuda"))
    norms = poison(torch.empty(x.shape[:-1], dtype=torch.float32, device="cuda"))
    kc.launch_compress(x, rotation, boundaries, bits, centroids, nc, signs, packed, norms)
    torch.cuda.synchronize()
    return packed, norms


def _problems(label, x, packed, norms, rotation, boundaries, centroids, bits, nc) -> list[str]:
    """What differs from the reference (empty when the kernel's outputs are right)."""
    d = x.shape[-1]
    if packed.shape != x.shape[:-1] + (packed_size(d, bits),) or packed.dtype != torch.uint8:
        return [f"{label}: packed is {packed.dtype} {list(packed.shape)}"]
    if norms.shape != x.shape[:-1] or norms.dtype != torch.float32:
        return [f"{label}: norms are {norms.dtype} {list(norms.shape)}"]
    problems = []
    ref_packed, ref_norms = reference_compress(x, rotation, boundaries, bits, centroids, nc)
    got = unpack_indices(packed, bits, d)
    want = unpack_indices(ref_packed, bits, d)
    near = _near_boundary(x, rotation, boundaries)
    bad = (got != want) & ~near
    if bad.any():
        where = bad.nonzero()[:4].tolist()
        pairs = [(w, int(got[tuple(w)]), int(want[tuple(w)])) for w in where]
        problems.append(
            f"{label}: {int(bad.sum())} of {bad.numel()} indices differ away from a boundary "
            f"(rows affected: {int(bad.flatten(0, -2).any(-1).sum())}); first (position, kernel, reference): {pairs}"
        )
    return problems + _norm_problems(label, x, norms, centroids[got] if nc else None)


def _norm_problems(label, x, norms, code_centroids=None) -> list[str]:
    """How ``norms`` miss ``|x|`` (``/ |code_centroids|`` with norm correction) computed in float64, beyond 2x the
    relative error of PyTorch's fp32 norms, or one fp32 rounding per level of a pairwise sum of D squares, the
    square root and, with norm correction, the second norm and the division; zero rows exactly 0."""
    if not torch.isfinite(norms).all():
        return [f"{label}: {int((~torch.isfinite(norms)).sum())} non-finite norms (poison left?)"]
    expect, in_fp32 = x.double().norm(dim=-1), x.float().norm(dim=-1)
    if code_centroids is not None:
        expect = expect / code_centroids.double().norm(dim=-1).clamp_min(TINY)
        in_fp32 = in_fp32 / code_centroids.float().norm(dim=-1).clamp_min(TINY)
    rows = expect > 0
    if not torch.all(norms[~rows] == 0):
        return [f"{label}: zero rows with nonzero norms"]
    levels = math.log2(x.shape[-1]) + 1
    floor = (2 * levels if code_centroids is not None else levels) * torch.finfo(torch.float32).eps
    relative, torch_relative = (n[rows].double() / expect[rows] for n in (norms, in_fp32))
    ones = torch.ones_like(relative)
    error, bound = max_error(relative, ones), dtype_error_bound(torch_relative, ones, torch.float32, floor=floor)
    if error > bound:
        return [f"{label}: norms off by up to {error:.3g} relative, over {bound:.3g} (first values "
                f"{norms.flatten()[:3].tolist()} vs {expect.flatten()[:3].tolist()})"]
    return []


def _check(label, x, packed, norms, rotation, boundaries, centroids, bits, nc):
    problems = _problems(label, x, packed, norms, rotation, boundaries, centroids, bits, nc)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path,head_dim,bits,dtype", CASES)
def test_compress_matches_reference(path, head_dim, bits, dtype, poison, rng_seed, cuda_gen):
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation, signs = _rotation(path, head_dim, seed % 1000)
    cb = lloyd_max_codebook(head_dim, bits)
    centroids, boundaries = cb.tensors("cuda")
    problems = []  # every view and setting runs before the test reports, to show the whole pattern
    for name, x in _views(head_dim, dtype, gen, big=head_dim == 128):
        for nc in (False, True):
            label = f"{path} D={head_dim} bits={bits} {dtype} {name} nc={nc} seed={seed}"
            packed, norms = _launch(x, rotation, boundaries, bits, centroids, nc, signs, poison)
            problems += _problems(label, x, packed, norms, rotation, boundaries, centroids, bits, nc)
    assert not problems, f"{len(problems)} failing settings:\n" + "\n".join(problems[:8])


@pytest.mark.parametrize("path", kc.ROTATION_PATHS)
def test_public_compress_equals_launch(path):
    """`compress` allocates fresh outputs of the right shape and returns what the launch writes."""
    head_dim, bits, dtype = 128, 4, torch.bfloat16
    rotation, signs = _rotation(path, head_dim, 5)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    x = torch.randn(3, 8, 33, head_dim, device="cuda", dtype=dtype)
    packed, norms = kc.compress(x, rotation, boundaries, bits, centroids, True, signs)
    assert packed.shape == (3, 8, 33, 64) and norms.shape == (3, 8, 33)
    assert packed.is_contiguous() and norms.is_contiguous()
    again, again_norms = kc.compress(x, rotation, boundaries, bits, centroids, True, signs)
    assert torch.equal(packed, again) and torch.equal(norms, again_norms)  # deterministic
    _check(path, x, packed, norms, rotation, boundaries, centroids, bits, True)
    empty_packed, empty_norms = kc.compress(x[:, :, :0], rotation, boundaries, bits, centroids, False, signs)
    assert empty_packed.shape == (3, 8, 0, 64) and empty_norms.shape == (3, 8, 0)


@pytest.mark.parametrize("path", kc.ROTATION_PATHS)
@pytest.mark.parametrize("spacing", ["equal", "0.01"])
def test_closely_spaced_boundaries_use_the_exact_scan(path, spacing, poison):
    """4-bit boundaries closer than the lookup tables' cells still bucketize exactly: "equal" (1e-4 apart and two
    equal ones: exact scan) and "0.01" (too close for the tensor-core kernel's full-range table: exact scan there;
    the FWHT and dense kernels still use their saturating 64-cell table)."""
    head_dim, bits = 128, 4
    dtype = next(t for p, d, b, t in CASES if (p, d, b) == (path, head_dim, bits))
    rotation, signs = _rotation(path, head_dim, 11)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    boundaries = boundaries.clone()
    if spacing == "equal":
        boundaries[8] = boundaries[7] + 1e-4
        boundaries[10] = boundaries[9]
    else:
        boundaries[8] = boundaries[7] + 0.01
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = _inputs((2000, head_dim), dtype, gen)
    for nc in (False, True):
        packed, norms = _launch(x, rotation, boundaries, bits, centroids, nc, signs, poison)
        _check(f"{path} {spacing} boundaries nc={nc}", x, packed, norms, rotation, boundaries, centroids, bits, nc)


def _stress_rows(rows: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gaussian rows (scales 1e-3..1e3), heavy-tailed rows (one coordinate 1e3 x the rest), sparse rows (1-3
    nonzeros: rotated values +-k/sqrt(D) for small integers k) and rows of +-1: many coordinates land within
    1e-5 of some boundary, and the tensor core's fp32 accumulation sees large dynamic ranges."""
    x = torch.randn(rows, head_dim, generator=gen, device="cuda")
    x *= 10.0 ** torch.randint(-3, 4, (rows, 1), generator=gen, device="cuda").float()
    q = rows // 4
    x[q : 2 * q, 0] *= 1e3
    sparse = torch.zeros(q, head_dim, device="cuda")
    for k in range(3):
        cols = torch.randint(0, head_dim, (q,), generator=gen, device="cuda")
        vals = torch.randint(-2, 3, (q,), generator=gen, device="cuda").float()
        sparse[torch.arange(q, device="cuda"), cols] += vals
    x[2 * q : 3 * q] = sparse
    x[3 * q : 3 * q + q // 2] = torch.randint(0, 2, (q // 2, head_dim), generator=gen, device="cuda").float() * 2 - 1
    return x.clamp(-6e4, 6e4).to(dtype)  # finite in fp16 too


@pytest.mark.parametrize("head_dim,dtype", [(128, torch.bfloat16), (128, torch.float16), (64, torch.bfloat16)])
def test_tensor_core_hadamard_on_many_vectors_near_boundaries(head_dim, dtype, poison, rng_seed, cuda_gen):
    """2^20 vectors through the tensor-core transform: no index differs from the reference unless the exact
    (float64) rotated coordinate is within 1e-6 of a boundary. With ~1e5 coordinates within 1e-5 of a boundary,
    an error in the transform's summation order or rounding larger than ~1e-6 would show."""
    bits, rows = 4, 1 << 20
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation, signs = _rotation("hadamard", head_dim, seed % 1000)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    x = _stress_rows(rows, head_dim, dtype, gen)
    assert kc.hadamard_uses_mma(head_dim, dtype)
    packed, norms = _launch(x, rotation, boundaries, bits, centroids, False, signs, poison)
    got = unpack_indices(packed, bits, head_dim)
    x64 = x.double()
    n64 = x64.norm(dim=-1)
    y = (x64 / n64.clamp_min(TINY).unsqueeze(-1)) @ rotation.double().T
    b64 = boundaries.double()
    want = torch.bucketize(y, b64, right=True)  # exact float64 indices
    # Distance to the nearest boundary: the one just below or just above y.
    below = b64[(want - 1).clamp_min(0)].masked_fill(want == 0, float("inf"))
    above = b64[want.clamp_max(len(b64) - 1)].masked_fill(want == len(b64), float("inf"))
    dist = torch.minimum((y - below).abs(), (above - y).abs())
    differ = got != want
    assert int((dist < 1e-5).sum()) > 1000, "the stress set should put many coordinates near a boundary"
    worst = dist[differ].max().item() if differ.any() else 0.0
    assert worst < NEAR, (f"seed={seed}: {int(differ.sum())} indices differ from float64 bucketize, up to {worst:.3g} "
                          f"from a boundary ({int((differ & (dist >= NEAR)).sum())} beyond {NEAR})")
    problems = _norm_problems(f"seed={seed}", x, norms)
    assert not problems, problems


def test_tiny_rows_take_the_exact_fallback(poison):
    """Tiles whose squared norms fall below the full-range table's guard (1e-30) use the exact scan: rows of
    magnitude ~1e-18 mixed with ordinary rows in the same 8-row tiles still match the reference."""
    head_dim, bits = 128, 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    rotation, signs = _rotation("hadamard", head_dim, 4)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    x = torch.randn(4096, head_dim, generator=gen, device="cuda")
    x[::3] *= 3e-18
    x = x.to(torch.bfloat16)
    for nc in (False, True):
        packed, norms = _launch(x, rotation, boundaries, bits, centroids, nc, signs, poison)
        _check(f"tiny rows nc={nc}", x, packed, norms, rotation, boundaries, centroids, bits, nc)


@pytest.mark.parametrize("head_dim, bits", [(96, 4), (64, 1)])
def test_unsupported_sizes_run_the_reference_through_ops(head_dim, bits):
    """head_dim 96 and bits 1 have no kernel: the wrapper refuses them with the reason, and ops.compress on the
    "cuda" backend returns the reference's result on the GPU."""
    x = torch.randn(5, head_dim, device="cuda")
    rotation = random_rotation(head_dim, 0, device="cuda")
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    reason = kc.unsupported(head_dim, bits)
    assert reason is not None and kc.unsupported(128, 4) is None
    with pytest.raises(ValueError, match=f"head_dim={head_dim}, bits={bits}"):
        kc.compress(x, rotation, boundaries, bits, centroids)
    got = ops.compress(x, rotation, boundaries, bits, centroids, backend="cuda")
    want = reference_compress(x, rotation, boundaries, bits, centroids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _good_args(**overrides):
    head_dim, bits = 128, 4
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    args = dict(
        x=torch.randn(4, head_dim, device="cuda", dtype=torch.bfloat16),
        rotation=random_rotation(head_dim, 0, "hadamard", device="cuda"),
        boundaries=boundaries,
        bits=bits,
        centroids=centroids,
        norm_correction=False,
        hadamard_signs=hadamard_signs(head_dim, 0, device="cuda"),
    )
    args.update(overrides)
    return args


# Factories, not tensors: collection must not touch CUDA on machines without a GPU.
BAD_INPUTS = [
    (lambda: dict(x=torch.randn(4, 128)), ValueError, r"`x` must be a CUDA tensor.*cpu"),
    (lambda: dict(x=torch.ones(4, 128, device="cuda", dtype=torch.int32)), ValueError, r"`x` must have dtype"),
    (lambda: dict(x=[1.0, 2.0]), TypeError, r"`x` must be a torch.Tensor"),
    (lambda: dict(rotation=torch.eye(128, device="cuda", dtype=torch.float64)), ValueError,
     r"`rotation` must have dtype"),
    (lambda: dict(rotation=torch.eye(128)), ValueError, r"`rotation` must be a CUDA tensor.*cpu"),
    (lambda: dict(boundaries=torch.zeros(7, device="cuda")), ValueError, r"`boundaries` must have shape \[15\]"),
    (lambda: dict(norm_correction=True, centroids=None), ValueError, r"`centroids` are required"),
] + CODEBOOK_AND_ROTATION_BAD_INPUTS


@pytest.mark.parametrize("overrides,error,match", BAD_INPUTS)
def test_bad_inputs_raise(overrides, error, match):
    with pytest.raises(error, match=match):
        kc.compress(**_good_args(**overrides()))


# ---- compress_into: the block of rows written straight into a store at a device offset

def _store(lead: tuple[int, ...], slots: int, head_dim: int, bits: int, poison) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.empty(lead + (slots, packed_size(head_dim, bits)), dtype=torch.uint8, device="cuda")
    return poison(packed), poison(torch.empty(lead + (slots,), device="cuda"))


def _inline_store(lead: tuple[int, ...], slots: int, row_bytes: int, fill: int):
    """A uint8 store ``rows [..., N, row_bytes + 4]`` filled with ``fill``, and its views ``packed`` (the codes) and
    ``norms`` (the fp32 norm after them): rows ``row_bytes + 4`` bytes apart."""
    rows = torch.full(lead + (slots, row_bytes + 4), fill, dtype=torch.uint8, device="cuda")
    return rows, rows[..., :row_bytes], rows[..., row_bytes:].view(torch.float32).squeeze(-1)


def _store_problems(label, x, packed, norms, first, rotation, boundaries, centroids, bits, nc) -> list[str]:
    """What differs from the reference in rows ``first .. first + n`` of the store, and any row outside them that
    lost its poison (``first`` None: no row may be written)."""
    n, slots = x.shape[-2], packed.shape[-2]
    outside = torch.ones(slots, dtype=torch.bool, device="cuda")
    problems = []
    if first is not None:
        outside[first : first + n] = False
        block = slice(first, first + n)
        problems += _problems(label, x, packed[..., block, :], norms[..., block], rotation, boundaries, centroids,
                              bits, nc)
    if not ((packed[..., outside, :] == 0xAB).all() and norms[..., outside].isnan().all()):
        problems.append(f"{label}: rows outside {first} .. {first}+{n} were written")
    return problems


@pytest.mark.parametrize("path", kc.ROTATION_PATHS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_compress_into_writes_the_block_at_a_device_offset(path, head_dim, bits, poison, rng_seed, cuda_gen):
    """Every dtype (fp16/bf16: the tensor-core kernel on the Hadamard path; fp32: the FWHT one) into poisoned stores
    at random offsets read from device memory: the block equals the reference's codes, nothing else is written.
    Shapes: one row per head, odd counts, HF's strided [B, L, H, D] view, and enough rows for several rounds of the
    persistent grid."""
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation, signs = _rotation(path, head_dim, seed % 1000)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    shapes = [(1, 8, 17, 1), (3, 2, 129, 97), (2, 4, 300, 64)]
    if head_dim == 128:
        shapes.append((4, 8, 4100, 4096))
    problems = []
    for dtype in DTYPES:
        for batch, heads, slots, n in shapes:
            nc = n % 2 == 1
            x = _inputs((batch, n, heads, head_dim), dtype, gen).transpose(1, 2)
            first = int(torch.randint(0, slots - n + 1, (), generator=gen, device="cuda"))
            packed, norms = _store((batch, heads), slots, head_dim, bits, poison)
            start = torch.tensor(first, device="cuda")
            kc.compress_into(x, rotation, boundaries, bits, packed, norms, start, centroids, nc, signs)
            torch.cuda.synchronize()
            label = f"{path} D={head_dim} bits={bits} {dtype} [{batch}, {heads}, {n}] into {slots} at {first}"
            label += f" seed={seed}"
            problems += _store_problems(label, x, packed, norms, first, rotation, boundaries, centroids, bits, nc)
    assert not problems, f"{len(problems)} failing settings:\n" + "\n".join(problems[:8])


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_compress_into_out_of_range_start_writes_nothing(backend, poison):
    """A device start below 0 or past N - n: the kernel returns before writing, the reference on the GPU rewrites
    what the rows hold (neither reads the value on the host)."""
    head_dim, bits, slots, n = 128, 4, 40, 16
    rotation, signs = _rotation("hadamard", head_dim, 2)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(2, 4, n, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    for first in (-1, slots - n + 1, 10**12):
        packed, norms = _store((2, 4), slots, head_dim, bits, poison)
        start = torch.tensor([first], device="cuda")
        if backend == "kernel":
            kc.compress_into(x, rotation, boundaries, bits, packed, norms, start, centroids, False, signs)
        else:
            reference_compress_into(x, rotation, boundaries, bits, packed, norms, start, centroids, False, signs)
        torch.cuda.synchronize()
        problems = _store_problems(f"start={first}", x, packed, norms, None, rotation, boundaries, centroids, bits,
                                   False)
        assert not problems, problems


def test_compress_into_replays_in_a_cuda_graph_at_the_counters_offset(poison):
    """One captured launch, replayed after the start tensor and the input change: each replay writes its block where
    the device counter says (or nothing, out of range), as a static cache's captured decode step does."""
    head_dim, bits, slots, n = 128, 4, 100, 16
    rotation, signs = _rotation("hadamard", head_dim, 9)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.empty(2, 4, n, head_dim, device="cuda", dtype=torch.bfloat16)
    packed, norms = _store((2, 4), slots, head_dim, bits, poison)
    start = torch.zeros((), dtype=torch.int64, device="cuda")
    kc.compress_into(x.normal_(generator=gen), rotation, boundaries, bits, packed, norms, start, centroids, True,
                     signs)  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kc.compress_into(x, rotation, boundaries, bits, packed, norms, start, centroids, True, signs)
    for first in (0, 37, slots - n, slots - n + 1, -3):
        poison(packed), poison(norms)
        x.copy_(_inputs(tuple(x.shape), x.dtype, gen))
        start.fill_(first)
        graph.replay()
        torch.cuda.synchronize()
        written = first if 0 <= first <= slots - n else None
        problems = _store_problems(f"replay at {first}", x, packed, norms, written, rotation, boundaries, centroids,
                                   bits, True)
        assert not problems, problems


def test_compress_into_through_ops_and_the_custom_op(poison):
    """The "cuda" backend's `ops.compress_into` and `flashquant::compress_into` run the kernel (bit for bit the
    wrapper's result); head_dim 96 has no kernel and runs the reference on the GPU."""
    bits, slots, n = 4, 50, 8
    gen = torch.Generator(device="cuda").manual_seed(13)
    for head_dim in (128, 96):
        rotation = random_rotation(head_dim, 1, device="cuda")
        centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
        x = torch.randn(2, 2, n, head_dim, device="cuda", generator=gen)
        start = torch.tensor(21, device="cuda")
        via_ops, via_op, want = (_store((2, 2), slots, head_dim, bits, poison) for _ in range(3))
        ops.compress_into(x, rotation, boundaries, bits, *via_ops, start, centroids, backend="cuda")
        torch.ops.flashquant.compress_into(x, rotation, boundaries, centroids, None, bits, False, "cuda", *via_op,
                                           start)
        if head_dim == 128:
            kc.compress_into(x, rotation, boundaries, bits, *want, start, centroids)
        else:
            reference_compress_into(x, rotation, boundaries, bits, *want, start, centroids)
        for got in (via_ops, via_op):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1].nan_to_num(), want[1].nan_to_num()), head_dim


BAD_STORES = [
    (lambda p, m: dict(packed=p.transpose(0, 1)), r"`packed` must have one uniform stride .* \(1920, 7680, 64, 1\)"),
    (lambda p, m: dict(norms=m.transpose(0, 1)), r"`norms` must have one uniform stride .* \(30, 120, 1\)"),
    (lambda p, m: dict(packed=torch.zeros((4, 4, 30, 70), dtype=torch.uint8, device="cuda")[..., :64]),
     r"`packed` rows must start at 4-byte aligned addresses \(row pitch 70 bytes"),
    (lambda p, m: dict(packed=p[:, :, :20], norms=m[:, :, :20]), r"`packed` must have one uniform stride"),
    (lambda p, m: dict(packed=p[..., :63]), r"`packed` must be uint8 of shape \[4, 4, N, 64\]"),
    (lambda p, m: dict(start=torch.tensor(1.5, device="cuda")), r"`start` must be an int64 tensor"),
    (lambda p, m: dict(start=torch.tensor(1)), r"must share a device"),
]


@pytest.mark.parametrize("path", kc.ROTATION_PATHS)
@pytest.mark.parametrize("head_dim", kc.HEAD_DIMS)
@pytest.mark.parametrize("bits", kc.BITS)
def test_compress_into_inline_rows_holds_what_compress_returns(path, head_dim, bits, rng_seed, cuda_gen):
    """Codes and fp32 norm side by side in rows of one uint8 buffer (filled with 0xFF), written through the strided
    views: rows ``start .. start + n`` hold bit for bit what ``compress`` returns for the same ``x`` (the same
    kernel), every other byte keeps its 0xFF; a start outside [0, N - n] writes nothing. Every dtype, leading shapes
    of 0-3 dims (HF's strided [B, L, H, D] view among them), enough rows at D=128 for several rounds of the grid."""
    seed, gen = rng_seed, cuda_gen  # the seed is printed with every failure
    rotation, signs = _rotation(path, head_dim, seed % 1000)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    row_bytes = packed_size(head_dim, bits)
    shapes = [((), 20, 7, False), ((1, 8), 17, 1, False), ((3, 2), 129, 97, True), ((2, 2, 3), 64, 64, False)]
    if head_dim == 128:
        shapes.append(((4, 8), 4100, 4096, True))
    problems = []
    for dtype in DTYPES:
        for lead, slots, n, hf_view in shapes:
            nc = n % 2 == 1
            if hf_view:  # [B, n, H, D] transposed to [B, H, n, D]
                x = _inputs((lead[0], n, *lead[1:], head_dim), dtype, gen).transpose(1, 2)
            else:
                x = _inputs(lead + (n, head_dim), dtype, gen)
            codes, code_norms = kc.compress(x, rotation, boundaries, bits, centroids, nc, signs)
            label = f"{path} D={head_dim} bits={bits} {dtype} {list(x.shape[:-1])} into {slots}"
            first = int(torch.randint(0, slots - n + 1, (), generator=gen, device="cuda"))
            for at in (first, -1, slots - n + 1):
                rows, packed, norms = _inline_store(lead, slots, row_bytes, 0xFF)
                kc.compress_into(x, rotation, boundaries, bits, packed, norms, torch.tensor(at, device="cuda"),
                                 centroids, nc, signs)
                want = torch.full_like(rows, 0xFF)
                if at == first:
                    want[..., first : first + n, :row_bytes] = codes
                    want[..., first : first + n, row_bytes:] = code_norms.unsqueeze(-1).view(torch.uint8)
                if not torch.equal(rows, want):
                    problems.append(f"{label} at {at} seed={seed}: {int((rows != want).sum())} bytes differ")
    assert not problems, f"{len(problems)} failing settings:\n" + "\n".join(problems[:8])


@pytest.mark.parametrize("overrides,match", BAD_STORES)
def test_compress_into_bad_stores_raise(overrides, match, poison):
    head_dim, bits = 128, 4
    args = _good_args()
    packed, norms = _store((4, 4), 30, head_dim, bits, poison)
    into = dict(packed=packed, norms=norms, start=torch.tensor(3, device="cuda"))
    into.update(overrides(packed, norms))
    x = torch.randn(4, 4, 5, head_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(14))
    x = x.to(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        kc.compress_into(x, args["rotation"], args["boundaries"], bits, into["packed"], into["norms"], into["start"],
                         args["centroids"], False, args["hadamard_signs"])
    assert (packed == 0xAB).all() and norms.isnan().all()


def test_compress_into_opcheck_on_the_kernel_path():
    """torch.library's checks of `flashquant::compress_into` with the kernel behind it: declared mutations, the fake
    under FakeTensor, AOT dispatch (what torch.compile runs)."""
    head_dim, bits = 128, 4
    rotation, signs = _rotation("hadamard", head_dim, 8)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cuda")
    x = torch.randn(2, 4, 16, head_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(15))
    x = x.to(torch.bfloat16)
    packed = torch.zeros(2, 4, 40, packed_size(head_dim, bits), dtype=torch.uint8, device="cuda")
    norms = torch.zeros(2, 4, 40, device="cuda")
    torch.library.opcheck(torch.ops.flashquant.compress_into.default,
                          (x, rotation, boundaries, centroids, signs, bits, True, "cuda", packed, norms,
                           torch.tensor(7, device="cuda")))
