"""Tiny paged (block sizes 8-64, GQA 4 and 8, every code width at blocks of 8 and 16) + contiguous decode (several
splits, so the merge runs too; every code width at head_dim 64 and 128, with register loads and, where the widths
and 16-byte aligned runs allow it, staged tiles, also over splits of several steps; the cache's layout of norms
after their code rows where it uses it) and a 40-split merge (the merge's deep-batch variant) for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/gpu/sanitize_decode.py [--warps 4] [--cupy-launch]
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_decode.py

``--warps`` sets the CTA shape of head_dim <= 128 (default: the tuned one), ``--cupy-launch`` launches through
CuPy instead of the cached cuLaunchKernel path. ``--dump DIR`` saves inputs and outputs for offline debugging.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashquant_hf.kernels.decode_launch as dl  # noqa: E402
from flashquant_hf import store_layout  # noqa: E402
from flashquant_hf.codebook import lloyd_max_codebook  # noqa: E402
from flashquant_hf.kernels.paged_decode import paged_decode  # noqa: E402
from flashquant_hf.kernels.merge_partials import merge_partials  # noqa: E402
from flashquant_hf.kernels.tq_decode import tq_decode  # noqa: E402
from flashquant_hf.paged import PagedLayout  # noqa: E402


def codebook(bits: int, head_dim: int = 128) -> torch.Tensor:
    return torch.tensor(lloyd_max_codebook(head_dim, bits).centroids, dtype=torch.float32, device="cuda")


def paged_case(q: torch.Tensor, c: torch.Tensor, block_size: int, bits: tuple[int, int] = (4, 4)):
    """Ragged paged decode (700, 3 and 0 keys, shuffled blocks) at one block size."""
    layout = PagedLayout(block_size=block_size, num_kv_heads=2, head_dim=128, k_bits=bits[0], v_bits=bits[1])
    lens = [700, 3, 0]
    need = [-(-n // block_size) for n in lens]
    blocks = torch.randint(0, 256, (sum(need) + 1, 2, layout.head_block_bytes), dtype=torch.uint8, device=q.device)
    for section in layout.sections(blocks)[1::2]:
        section.uniform_(0.5, 2.0)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    ids = torch.randperm(sum(need)).tolist()
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[sum(need[:i]) : sum(need[:i]) + n], dtype=torch.int32)
    ck, cv = (c, c) if bits == (4, 4) else (codebook(bits[0]), codebook(bits[1]))
    out, lse = paged_decode(q, blocks, table.to(q.device), torch.tensor(lens, dtype=torch.int32, device=q.device),
                            ck, cv, *bits, 128**-0.5, block_size)
    return out, lse, blocks, table, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warps", type=int, choices=dl.WARP_CHOICES, default=dl.WARPS)
    parser.add_argument("--cupy-launch", action="store_true")
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args()
    dl.WARPS = args.warps
    dl.FAST_LAUNCH = not args.cupy_launch
    torch.manual_seed(0)
    dev = "cuda"
    c = torch.tensor(lloyd_max_codebook(128, 4).centroids, dtype=torch.float32, device=dev)
    q = torch.randn(3, 8, 128, device=dev, dtype=torch.bfloat16)
    for block_size in (8, 16, 32, 64):  # the general page path (8) and the whole-tile one (>= 16)
        out, lse, blocks, table, lens = paged_case(q, c, block_size)
        assert torch.isfinite(out).all(), f"block size {block_size}"
    # GQA 8: the 8-slot build (GQA 4 above runs the paired one)
    q8 = torch.randn(3, 16, 128, device=dev, dtype=torch.bfloat16)
    assert torch.isfinite(paged_case(q8, c, 16)[0]).all()
    k = torch.randint(0, 256, (2, 2, 900, 64), dtype=torch.uint8, device=dev)[:, :, :777]
    v = torch.randint(0, 256, (2, 2, 777, 64), dtype=torch.uint8, device=dev)
    kn, vn = torch.rand(2, 2, 777, device=dev), torch.rand(2, 2, 777, device=dev)
    bias = torch.zeros(2, 777, device=dev)
    bias[1, :100] = float("-inf")
    out2, lse2 = tq_decode(q[:2, :, None], k, kn, v, vn, c, c, 4, 4, 128**-0.5, key_bias=bias)
    widths = [(k_bits, v_bits) for k_bits in dl.BITS for v_bits in dl.BITS if (k_bits, v_bits) != (4, 4)]
    for bits in widths:
        for block_size in (8, 16):
            assert torch.isfinite(paged_case(q, c, block_size, bits)[0]).all(), f"bits {bits}, blocks {block_size}"
        for head_dim in (64, 128):
            kw = torch.randint(0, 256, (2, 2, 800, head_dim * bits[0] // 8), dtype=torch.uint8, device=dev)[:, :, :777]
            vw = torch.randint(0, 256, (2, 2, 777, head_dim * bits[1] // 8), dtype=torch.uint8, device=dev)
            qw = torch.randn(2, 8, 1, head_dim, device=dev, dtype=torch.float16)
            ow, _ = tq_decode(qw, kw, kn, vw, vn, codebook(bits[0], head_dim), codebook(bits[1], head_dim), *bits,
                              head_dim**-0.5)
            assert torch.isfinite(ow).all(), f"bits {bits}, head_dim {head_dim}"
            # 16-byte aligned runs: the staged tiles (sm_90, narrow widths), whose partial last tile reads global memory
            full = [torch.randint(0, 256, (2, 2, 784, t.shape[-1]), dtype=torch.uint8, device=dev) for t in (kw, vw)]
            full_norms = [torch.rand(2, 2, 784, device=dev) for _ in range(2)]
            (kw_s, vw_s), (kn_s, vn_s) = ([t[:, :, :777] for t in ts] for ts in (full, full_norms))
            ow, _ = tq_decode(qw, kw_s, kn_s, vw_s, vn_s, codebook(bits[0], head_dim), codebook(bits[1], head_dim),
                              *bits, head_dim**-0.5)
            assert torch.isfinite(ow).all(), f"bits {bits}, head_dim {head_dim}, aligned runs"
            sides = store_layout.inline_norms(head_dim, *bits)
            if any(sides):  # the cache's layout: norms after their code rows where inline_norms says
                stored = []
                for inline, codes, norms in zip(sides, full, full_norms):
                    if inline:
                        codes, norms = store_layout.split_rows(store_layout.joined_rows(codes, norms))
                    stored += [codes[:, :, :777], norms[:, :, :777]]
                assert dl.staged_runs(head_dim, *bits, dl.contiguous_runs(*stored)) in (0, dl.RUNS_INLINE)
                ow, _ = tq_decode(qw, *stored, codebook(bits[0], head_dim), codebook(bits[1], head_dim), *bits,
                                  head_dim**-0.5)
                assert torch.isfinite(ow).all(), f"bits {bits}, head_dim {head_dim}, inline norms"
    # staged tiles over splits of several steps (64 units: four splits of 512-640 keys), so the stages are refilled
    long_full = [torch.randint(0, 256, (8, 8, 2140, 48), dtype=torch.uint8, device=dev) for _ in range(2)]
    long_norms = [torch.rand(8, 8, 2140, device=dev) for _ in range(2)]
    (kl, vl), (knl, vnl) = ([t[:, :, :2125] for t in ts] for ts in (long_full, long_norms))
    ql = torch.randn(8, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    ol, _ = tq_decode(ql, kl, knl, vl, vnl, codebook(3), codebook(3), 3, 3, 128**-0.5)
    assert torch.isfinite(ol).all(), "staged steps"
    rows = [store_layout.joined_rows(t, n) for t, n in zip(long_full, long_norms)]
    inline = [t for r in rows for t in store_layout.split_rows(r[:, :, :2125])]
    ol, _ = tq_decode(ql, *inline, codebook(3), codebook(3), 3, 3, 128**-0.5)
    assert torch.isfinite(ol).all(), "staged steps, inline norms"
    outs, lses = torch.randn(40, 5, 128, device=dev), torch.randn(40, 5, device=dev)
    lses[3] = float("-inf")  # an empty split
    merged, _ = merge_partials(outs, lses)
    torch.cuda.synchronize()
    if args.dump is not None:
        torch.save({"q": q, "blocks": blocks, "table": table, "lens": lens, "out": out, "lse": lse, "k": k, "kn": kn,
                    "v": v, "vn": vn, "bias": bias, "out2": out2, "lse2": lse2, "c": c},
                   args.dump / "decode_dump.pt")
    assert torch.isfinite(out).all() and torch.isfinite(out2).all() and torch.isfinite(merged).all()
    print("sanitize_decode: ok", tuple(out.shape), tuple(out2.shape), f"warps {dl.WARPS}, fast launch {dl.FAST_LAUNCH}")


if __name__ == "__main__":
    main()
