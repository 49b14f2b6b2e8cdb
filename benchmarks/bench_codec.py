"""Compress / decompress kernels against the HBM ceiling: 4M head vectors of D=128, bf16, TQ4.

Bandwidth fractions divide the bytes a kernel must move (compress: bf16 input read + packed codes and fp32
norms written; decompress: codes and norms read + bf16 output written) by its median time, and that by a
device-to-device copy measured in the same run (benchmarks/timing.copy_bandwidth_gbs). Inputs are rotated
so that no run finds its data in L2.

Headline names: ``compress_hbm_fraction`` (best rotation path; docs/kernels_codec.md says which) and
``decompress_hbm_fraction`` (the rotated-space kernel the attention path uses). Per-path figures carry the
path in the name; ``compress_hbm_fraction_hadamard_d64`` is the Hadamard compress at head_dim 64 (8M rows, the
same bytes).

``python -m benchmarks.bench_codec --ncu-probe`` launches only the default compress kernel a few times at the
benchmark's size (for ``ncu --kernel-name regex:tq_compress``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.timing import copies_to_exceed_l2, copy_bandwidth_gbs, time_ms

ROWS = 4 * 1024 * 1024
HEAD_DIM = 128
BITS = 4
DTYPE = torch.bfloat16


def _precompile(device: torch.device) -> None:
    """Compile every kernel timed here at once (NVRTC releases the GIL; the GPU machine has 16 cores)."""
    from flashquant_hf.kernels import compress as kc
    from flashquant_hf.kernels import decompress as kd
    from flashquant_hf.kernels import loader

    jobs = [(kc.CUDA_SOURCE, kc.kernel_name(p, HEAD_DIM, BITS, DTYPE)) for p in kc.ROTATION_PATHS]
    decompress_kernels = (("dequantize_rotated", DTYPE), ("dequantize_rotated", torch.float32),
                          ("decompress_hadamard", DTYPE))
    jobs += [(kd.CUDA_SOURCE, kd.kernel_name(k, HEAD_DIM, BITS, t)) for k, t in decompress_kernels]
    jobs.append((kc.CUDA_SOURCE, kc.kernel_name("hadamard", 64, BITS, DTYPE)))
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda j: loader.get_kernel(j[0], j[1], device), jobs))


def run(record) -> None:
    from flashquant_hf.codebook import lloyd_max_codebook
    from flashquant_hf.kernels import compress as kc
    from flashquant_hf.kernels import decompress as kd
    from flashquant_hf.packing import packed_size, unpack_indices
    from flashquant_hf.rotation import hadamard_signs, random_rotation

    device = torch.device("cuda", torch.cuda.current_device())
    _precompile(device)
    copy_gbs = copy_bandwidth_gbs()
    record("codec_copy_bandwidth", copy_gbs, "GB/s")

    nbytes = packed_size(HEAD_DIM, BITS)
    centroids, boundaries = lloyd_max_codebook(HEAD_DIM, BITS).tensors(device)
    rotations = {
        "haar": (random_rotation(HEAD_DIM, 0, "haar", device=device), None),
        "hadamard": (random_rotation(HEAD_DIM, 0, "hadamard", device=device),
                     hadamard_signs(HEAD_DIM, 0, device=device)),
    }
    in_bytes = ROWS * HEAD_DIM * DTYPE.itemsize
    code_bytes = ROWS * (nbytes + 4)
    sets = copies_to_exceed_l2(in_bytes)
    xs = [torch.randn(ROWS, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(sets)]
    packs = [torch.empty(ROWS, nbytes, dtype=torch.uint8, device=device) for _ in range(sets)]
    norms = [torch.empty(ROWS, device=device) for _ in range(sets)]

    def compress_fns(rotation, signs):
        return [
            (lambda i=i: kc.launch_compress(xs[i], rotation, boundaries, BITS, centroids, False, signs, packs[i],
                                            norms[i]))
            for i in range(sets)
        ]

    # ---- compress: bf16 read + codes and norms written
    fractions = {}
    for name, (rotation, signs) in rotations.items():
        ms = time_ms(compress_fns(rotation, signs))
        fractions[name] = (in_bytes + code_bytes) / (ms * 1e-3) / 1e9 / copy_gbs
        record(f"compress_ms_{name}", ms, "ms")
        record(f"compress_hbm_fraction_{name}", fractions[name], "fraction", ">= 0.60" if name == "hadamard" else None)
    best = max(fractions, key=fractions.get)
    record("compress_hbm_fraction", fractions[best], "fraction", f">= 0.60 (best path: {best})")

    # Sanity at full size: the two rotation paths index the same vectors the same way up to a few ties.
    reference_codes = {}
    for name, (rotation, signs) in rotations.items():
        kc.launch_compress(xs[0], rotation, boundaries, BITS, centroids, False, signs, packs[0], norms[0])
        reference_codes[name] = (packs[0].clone(), norms[0].clone())
    norms_h = reference_codes["hadamard"][1]
    # Correctness at the benchmark's size (first 64K rows) against the reference, so that this run's numbers
    # come with their own check: indices differing away from a boundary (must be 0), norms' relative error.
    from flashquant_hf.reference.compress import compress as reference_compress

    check_rows = 1 << 16
    x_check = xs[0][:check_rows]
    for name, (rotation, _) in rotations.items():
        ref_packed, ref_norms = reference_compress(x_check, rotation, boundaries, BITS)
        got = unpack_indices(reference_codes[name][0][:check_rows], BITS, HEAD_DIM)
        want = unpack_indices(ref_packed, BITS, HEAD_DIM)
        unit = x_check.double() / x_check.double().norm(dim=-1, keepdim=True).clamp_min(1e-300)
        y = unit @ rotation.double().T
        near = (y.unsqueeze(-1) - boundaries.double()).abs().amin(-1) < 1e-6
        record(f"compress_check_index_mismatch_{name}", ((got != want) & ~near).float().mean().item(), "fraction", "0")
        norm_err = ((reference_codes[name][1][:check_rows] - ref_norms).abs() / ref_norms).max().item()
        record(f"compress_check_norm_rel_err_{name}", norm_err, "relative", "< 1e-5")

    # head_dim 64 (twice the rows, the same bytes).
    _compress_d64(record, copy_gbs)

    # ---- decompress: codes and norms read + bf16 written
    out_bytes = ROWS * HEAD_DIM * DTYPE.itemsize
    codes = [reference_codes["hadamard"]] + [
        (torch.randint(0, 256, (ROWS, nbytes), dtype=torch.uint8, device=device), norms_h.clone())
        for _ in range(sets - 1)
    ]
    outs = [torch.empty(ROWS, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(sets)]

    def decompress_fns(signs):
        return [
            (lambda i=i: kd.launch_decompress(codes[i][0], codes[i][1], centroids, BITS, signs, outs[i]))
            for i in range(sets)
        ]

    ms_rot = time_ms(decompress_fns(None))
    record("decompress_ms_rotated", ms_rot, "ms")
    record("decompress_hbm_fraction", (code_bytes + out_bytes) / (ms_rot * 1e-3) / 1e9 / copy_gbs, "fraction",
           ">= 0.70")
    ms_had = time_ms(decompress_fns(rotations["hadamard"][1]))
    record("decompress_full_ms_hadamard", ms_had, "ms")
    record("decompress_hbm_fraction_hadamard", (code_bytes + out_bytes) / (ms_had * 1e-3) / 1e9 / copy_gbs, "fraction")
    reference_out = {}
    for signs_name, signs in (("rotated", None), ("hadamard", rotations["hadamard"][1])):
        kd.launch_decompress(codes[0][0], codes[0][1], centroids, BITS, signs, outs[0])
        reference_out[signs_name] = outs[0].clone()
    # Correctness at this size against the reference (first 64K rows): rotated must be exact.
    from flashquant_hf.reference.decompress import decompress as reference_decompress
    from flashquant_hf.reference.decompress import dequantize_rotated as reference_dequantize

    sub_codes, sub_norms = codes[0][0][:check_rows], codes[0][1][:check_rows]
    want = reference_dequantize(sub_codes, sub_norms, centroids, BITS, HEAD_DIM).to(DTYPE)
    differing = (reference_out["rotated"][:check_rows] != want).sum().item()
    record("decompress_check_rotated_values_differing", differing, "count", "0")
    want = reference_decompress(sub_codes, sub_norms, rotations["hadamard"][0], centroids, BITS, HEAD_DIM).double()
    gap = (reference_out["hadamard"][:check_rows].double() - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)
    record("decompress_check_hadamard_rel_err", gap.max().item(), "relative", "<= 1e-3 + bf16 ulp (0.0078)")

    # Full decompress with a dense (Haar) rotation: rotated-space kernel in fp32 + one fp32 GEMM (no TF32).
    haar = rotations["haar"][0]
    codes_haar = reference_codes["haar"]
    del xs, packs, norms, outs
    torch.cuda.empty_cache()
    ms_haar = time_ms(lambda: kd.decompress(codes_haar[0], codes_haar[1], haar, centroids, BITS, HEAD_DIM, DTYPE))
    record("decompress_full_ms_haar", ms_haar, "ms")


def _compress_d64(record, copy_gbs: float) -> None:
    from flashquant_hf.codebook import lloyd_max_codebook
    from flashquant_hf.kernels import compress as kc
    from flashquant_hf.packing import packed_size
    from flashquant_hf.rotation import hadamard_signs, random_rotation

    device = torch.device("cuda", torch.cuda.current_device())
    head_dim, rows = 64, 2 * ROWS
    nbytes = packed_size(head_dim, BITS)
    centroids, boundaries = lloyd_max_codebook(head_dim, BITS).tensors(device)
    rotation = random_rotation(head_dim, 0, "hadamard", device=device)
    signs = hadamard_signs(head_dim, 0, device=device)
    in_bytes = rows * head_dim * DTYPE.itemsize
    moved = in_bytes + rows * (nbytes + 4)
    sets = copies_to_exceed_l2(in_bytes)
    xs = [torch.randn(rows, head_dim, device=device, dtype=DTYPE) for _ in range(sets)]
    packs = [torch.empty(rows, nbytes, dtype=torch.uint8, device=device) for _ in range(sets)]
    norms = [torch.empty(rows, device=device) for _ in range(sets)]
    fns = [
        (lambda i=i: kc.launch_compress(xs[i], rotation, boundaries, BITS, centroids, False, signs, packs[i], norms[i]))
        for i in range(sets)
    ]
    ms = time_ms(fns)
    record("compress_hbm_fraction_hadamard_d64", moved / (ms * 1e-3) / 1e9 / copy_gbs, "fraction")


def _ncu_probe() -> None:
    """A few launches of the default compress kernel at the benchmark's size, nothing else (for ncu)."""
    from flashquant_hf.codebook import lloyd_max_codebook
    from flashquant_hf.kernels import compress as kc
    from flashquant_hf.packing import packed_size
    from flashquant_hf.rotation import hadamard_signs, random_rotation

    device = torch.device("cuda", torch.cuda.current_device())
    centroids, boundaries = lloyd_max_codebook(HEAD_DIM, BITS).tensors(device)
    rotation = random_rotation(HEAD_DIM, 0, "hadamard", device=device)
    signs = hadamard_signs(HEAD_DIM, 0, device=device)
    x = torch.randn(ROWS, HEAD_DIM, device=device, dtype=DTYPE)
    packed = torch.empty(ROWS, packed_size(HEAD_DIM, BITS), dtype=torch.uint8, device=device)
    norms = torch.empty(ROWS, device=device)
    for _ in range(3):
        kc.launch_compress(x, rotation, boundaries, BITS, centroids, False, signs, packed, norms)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    if "--ncu-probe" in sys.argv:
        _ncu_probe()
