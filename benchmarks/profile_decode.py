"""A few launches of the paged TQ4 decode on one benchmark shape, for Nsight Compute.

    ncu --clock-control none --set full -k regex:tq_decode_kernel -s 3 -c 1 -o decode \
        python benchmarks/profile_decode.py [--batch 8] [--keys 32768] [--warps 8] [--contiguous]

Without ncu it also prints the GPU time per call (CUDA events, inputs rotated beyond L2), so a tuning can be
checked quickly. ``--warps`` and ``--prefetch`` override the tuned ``decode_launch`` constants. ``--scaling`` fits
the contiguous decode's time against its length instead (the per-call cost that does not grow with the keys),
with and without programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import (  # noqa: E402
    BLOCK_SIZE, HEAD_DIM, _centroids, _contiguous_decode, _contiguous_query_sets, _paged_sets,
)
from benchmarks.timing import event_ms  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--contiguous", action="store_true", help="tq_decode on the contiguous layout")
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--time", action="store_true", help="also print the GPU time per call")
    parser.add_argument("--scaling", action="store_true",
                        help="time the contiguous decode at a fixed CTA count (B=8 with 4 splits, B=32 with 1) over "
                             "several lengths with programmatic launch off and on, and fit time = fixed + per-key "
                             "cost, then exit")
    args = parser.parse_args(argv)

    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.paged_decode import paged_decode

    if args.warps is not None:
        dl.WARPS = args.warps
    if args.prefetch is not None and args.contiguous:
        dl.CONTIGUOUS_PREFETCH_CHUNKS = args.prefetch
    elif args.prefetch is not None:
        dl.PREFETCH_CHUNKS = args.prefetch
    dl.clear_caches()
    dev = torch.device("cuda")
    c = _centroids(dev)
    scale = HEAD_DIM**-0.5
    if args.scaling:
        _scaling(dl, c, scale, dev)
        return
    if args.contiguous:
        sets = _contiguous_query_sets(args.batch, args.keys, dev)

        fn = _contiguous_decode(c, scale)
    else:
        sets = _paged_sets(args.batch, args.keys, BLOCK_SIZE, dev)

        def fn(s):
            return paged_decode(s[3], s[0], s[1], s[2], c, c, 4, 4, scale, BLOCK_SIZE, args.keys)

    for i in range(args.launches):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    if args.time:
        us = event_ms(fn, sets, calls=8, reps=30) * 1e3
        pf = dl.CONTIGUOUS_PREFETCH_CHUNKS if args.contiguous else dl.PREFETCH_CHUNKS
        print(f"profile_decode B={args.batch} N={args.keys} W={dl.WARPS} pf={pf} "
              f"{'contiguous' if args.contiguous else 'paged'}: {us:.1f} us/call")
    print("profile_decode: done")


def _scaling(dl, c, scale, dev):
    """GPU us per call of the contiguous decode at 256 CTAs (B=8 x 8 KV heads x 4 splits; B=32 x 8 x 1 split) for
    several lengths with ordinary and programmatic launches (interleaved), and the least-squares line through them:
    its intercept is the per-call cost that does not grow with the keys (launch, prologue, epilogue, merge)."""
    planner = dl.plan_decode
    default_pdl = dl.PROGRAMMATIC_LAUNCH
    variants = {"ordinary launch": False, "programmatic launch": True}

    def forced(splits):
        def plan(units, max_len, head_dim, slots, log2_block_size=None):
            free = planner(units, max_len, head_dim, slots, log2_block_size)
            length = -(-max_len // dl.GRANULE) * dl.GRANULE
            split_len = -(-(-(-length // splits)) // dl.GRANULE) * dl.GRANULE
            return dl.DecodePlan(splits, split_len, free.shared_mem, free.slots)

        plan.cache_clear = planner.cache_clear
        return plan

    fn = _contiguous_decode(c, scale)

    try:
        for batch, splits, lengths in ((32, 1, (16, 128, 2048, 8192)), (8, 4, (8192, 32768))):
            dl.plan_decode = forced(splits)
            points = {name: [] for name in variants}
            for keys in lengths:
                sets = _contiguous_query_sets(batch, keys, dev)
                for _ in range(2):
                    for name, programmatic in variants.items():
                        dl.PROGRAMMATIC_LAUNCH = programmatic
                        dl.clear_caches()
                        points[name].append((keys, event_ms(fn, sets, calls=8, reps=15) * 1e3))
                del sets
                torch.cuda.empty_cache()
            for name in variants:
                best = {}
                for keys, us in points[name]:
                    best[keys] = min(us, best.get(keys, float("inf")))
                cells = " ".join(f"N={k}:{u:.1f}" for k, u in best.items())
                fit = [(k, u) for k, u in best.items() if k >= 2048]
                mx = sum(k for k, _ in fit) / len(fit)
                my = sum(u for _, u in fit) / len(fit)
                slope = sum((k - mx) * (u - my) for k, u in fit) / sum((k - mx) ** 2 for k, _ in fit)
                print(f"scaling B={batch} splits={splits} {name}: {cells} us; fit N>=2K: fixed "
                      f"{my - slope * mx:.1f} us + {slope * 1024:.2f} us per 1024 keys", flush=True)
    finally:
        dl.plan_decode = planner
        dl.PROGRAMMATIC_LAUNCH = default_pdl
        dl.clear_caches()


if __name__ == "__main__":
    main()
