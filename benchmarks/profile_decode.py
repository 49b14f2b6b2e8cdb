"""A few launches of the paged TQ4 decode on one benchmark shape, for Nsight Compute.

    ncu --clock-control none --set full -k regex:tq_decode_kernel -s 3 -c 1 -o decode \
        python benchmarks/profile_decode.py [--batch 8] [--keys 32768] [--warps 8] [--contiguous]

Without ncu it also prints the GPU time per call (CUDA events, inputs rotated beyond L2), so a variant can be
checked quickly. ``--warps``, ``--prefetch`` and ``--options`` (extra NVRTC options) override the tuned
``paged_decode`` constants.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import (  # noqa: E402
    BLOCK_SIZE, HEAD_DIM, _centroids, _contiguous_decode, _contiguous_query_sets, _paged_sets,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--contiguous", action="store_true", help="tq_decode on the contiguous layout")
    parser.add_argument("--options", default=None, help="extra NVRTC options, e.g. -DFQD_QK_CHAINS=4")
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--time", action="store_true", help="also print the GPU time per call")
    parser.add_argument("--sweep", action="store_true",
                        help="time the paged decode at B=8/32K, 1/128K, 32/8K for every --sweep-options x L2 prefetch "
                             "0/1 (interleaved rounds, one process), then exit")
    parser.add_argument("--sweep-options", nargs="*", default=["", "-DFQD_QK_CHAINS=4"])
    parser.add_argument("--scaling", action="store_true",
                        help="time the contiguous decode at a fixed CTA count (B=8 with 4 splits, B=32 with 1) over "
                             "several lengths for every --sweep-options and fit time = fixed + per-key cost, then exit")
    parser.add_argument("--timeline", action="store_true",
                        help="build with -DFQD_TIMELINE=1 (per-warp globaltimer stamps, wrong results) and print where "
                             "the contiguous decode's time goes (the paged one's with --paged) at B=8/N=32K and "
                             "B=32/N=8K for every --sweep-options, then exit")
    parser.add_argument("--paged", action="store_true", help="--timeline: the paged decode (blocks of 16 keys)")
    args = parser.parse_args(argv)

    import flashquant_hf.kernels.paged_decode as pd

    if args.warps is not None:
        pd.WARPS = args.warps
    if args.prefetch is not None and args.contiguous:
        pd.CONTIGUOUS_PREFETCH_CHUNKS = args.prefetch
    elif args.prefetch is not None:
        pd.PREFETCH_CHUNKS = args.prefetch
    if args.options is not None:
        pd.KERNEL_OPTIONS = tuple(args.options.split())
    pd.clear_caches()
    dev = torch.device("cuda")
    c = _centroids(dev)
    scale = HEAD_DIM**-0.5
    if args.sweep:
        _sweep(pd, c, scale, dev, args.sweep_options)
        return
    if args.scaling:
        _scaling(pd, c, scale, dev, args.sweep_options)
        return
    if args.timeline:
        _timeline(pd, c, scale, dev, args.sweep_options, args.paged)
        return
    if args.contiguous:
        sets = _contiguous_query_sets(args.batch, args.keys, dev)

        fn = _contiguous_decode(c, scale)
    else:
        sets = _paged_sets(args.batch, args.keys, BLOCK_SIZE, dev)

        def fn(s):
            return pd.paged_decode(s[3], s[0], s[1], s[2], c, c, 4, 4, scale, BLOCK_SIZE, args.keys)

    for i in range(args.launches):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    if args.time:
        us = _gpu_us(fn, sets, reps=30)
        pf = pd.CONTIGUOUS_PREFETCH_CHUNKS if args.contiguous else pd.PREFETCH_CHUNKS
        print(f"profile_decode B={args.batch} N={args.keys} W={pd.WARPS} pf={pf} options={pd.KERNEL_OPTIONS} "
              f"{'contiguous' if args.contiguous else 'paged'}: {us:.1f} us/call")
    print("profile_decode: done")


def _gpu_us(fn, sets, reps=20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(reps):
        torch.cuda._sleep(4_000_000)
        start.record()
        for i in range(8):
            fn(sets[(r + i) % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 8 * 1e3)
    return statistics.median(times)


def _sweep(pd, c, scale, dev, options_list):
    """Median GPU us per call of each (options, prefetch) on each shape (paged B=8/N=32K, 1/128K, 32/8K and the
    contiguous layout at B=8/N=32K); 3 interleaved rounds against drift."""
    shapes = ((8, 32768, False), (1, 131072, False), (32, 8192, False), (8, 32768, True))
    variants = [(tuple(o.split()), pf) for o in options_list for pf in (0, 1)]
    results = {(v, sh): [] for v in variants for sh in shapes}
    for shape in shapes:
        batch, keys, contiguous = shape
        if contiguous:
            sets = _contiguous_query_sets(batch, keys, dev)

            fn = _contiguous_decode(c, scale)
        else:
            sets = _paged_sets(batch, keys, BLOCK_SIZE, dev)

            def fn(s, keys=keys):
                return pd.paged_decode(s[3], s[0], s[1], s[2], c, c, 4, 4, scale, BLOCK_SIZE, keys)

        for _ in range(3):
            for options, pf in variants:
                pd.KERNEL_OPTIONS = options
                if contiguous:
                    pd.CONTIGUOUS_PREFETCH_CHUNKS = pf
                else:
                    pd.PREFETCH_CHUNKS = pf
                pd.clear_caches()
                for i in range(4):
                    fn(sets[i % len(sets)])
                results[((options, pf), shape)].append(_gpu_us(fn, sets))
        del sets
        torch.cuda.empty_cache()
    for v in variants:
        cells = " ".join(f"{'contig' if cont else 'paged'}-B{b}/N{n // 1024}K={statistics.median(results[(v, (b, n, cont))]):.1f}"
                         for b, n, cont in shapes)
        print(f"sweep options={' '.join(v[0]) or '-'} pf={v[1]}: {cells} us")


def _scaling(pd, c, scale, dev, options_list):
    """GPU us per call of the contiguous decode at 256 CTAs (B=8 x 8 KV heads x 4 splits; B=32 x 8 x 1 split) for
    several lengths and each of ``options_list`` (NVRTC options, plus ``pdl`` for programmatic launches;
    interleaved), and the least-squares line through them: its intercept is the per-call cost that does not grow
    with the keys (launch, prologue, epilogue, merge)."""
    planner = pd.plan_decode
    default_options, default_pdl = pd.KERNEL_OPTIONS, pd.PROGRAMMATIC_LAUNCH

    def forced(splits):
        def plan(units, max_len, head_dim, slots, log2_block_size=None):
            free = planner(units, max_len, head_dim, slots, log2_block_size)
            length = -(-max_len // pd.GRANULE) * pd.GRANULE
            split_len = -(-(-(-length // splits)) // pd.GRANULE) * pd.GRANULE
            return pd.DecodePlan(splits, split_len, free.shared_mem, free.slots)

        plan.cache_clear = planner.cache_clear
        return plan

    fn = _contiguous_decode(c, scale)

    try:
        for batch, splits, lengths in ((32, 1, (16, 128, 2048, 8192)), (8, 4, (8192, 32768))):
            pd.plan_decode = forced(splits)
            points = {o: [] for o in options_list}
            for keys in lengths:
                sets = _contiguous_query_sets(batch, keys, dev)
                for _ in range(2):
                    for options in options_list:
                        pd.KERNEL_OPTIONS = tuple(o for o in options.split() if o != "pdl")
                        pd.PROGRAMMATIC_LAUNCH = "pdl" in options.split()
                        pd.clear_caches()
                        for i in range(4):
                            fn(sets[i % len(sets)])
                        points[options].append((keys, _gpu_us(fn, sets, reps=15)))
                del sets
                torch.cuda.empty_cache()
            for options in options_list:
                best = {}
                for keys, us in points[options]:
                    best[keys] = min(us, best.get(keys, float("inf")))
                cells = " ".join(f"N={k}:{u:.1f}" for k, u in best.items())
                fit = [(k, u) for k, u in best.items() if k >= 2048]
                mx = sum(k for k, _ in fit) / len(fit)
                my = sum(u for _, u in fit) / len(fit)
                slope = sum((k - mx) * (u - my) for k, u in fit) / sum((k - mx) ** 2 for k, _ in fit)
                print(f"scaling B={batch} splits={splits} options={options or '-'}: {cells} us; fit N>=2K: fixed "
                      f"{my - slope * mx:.1f} us + {slope * 1024:.2f} us per 1024 keys", flush=True)
    finally:
        pd.plan_decode = planner
        pd.KERNEL_OPTIONS, pd.PROGRAMMATIC_LAUNCH = default_options, default_pdl
        pd.clear_caches()


def _timeline(pd, c, scale, dev, options_list, paged=False):
    """Per-CTA phases of the contiguous (``paged``: paged) decode from a -DFQD_TIMELINE=1 build (merge kernel path):
    CTA entry, the grid-dependency wait, the prologue (to the barrier after the table build), each warp's loop, the
    spread of the warps' loop ends within a CTA, the epilogue, and when CTAs end (lone CTAs: alone on their SM). In
    us from the grid's first entry; min / median / p90 / max over CTAs (warps for the loop)."""
    default_options, default_cluster = pd.KERNEL_OPTIONS, pd.CLUSTER_MERGE

    def quantiles(x):
        x = sorted(x)
        return "/".join(f"{x[min(len(x) - 1, int(q * (len(x) - 1) + 0.5))]:.2f}" for q in (0, 0.5, 0.9, 1))

    try:
        pd.CLUSTER_MERGE = False  # the stamps go where the partials would
        for batch, keys in ((8, 32768), (32, 8192)):
            if paged:
                sets = _paged_sets(batch, keys, BLOCK_SIZE, dev)

                def fn(s, keys=keys):
                    return pd.paged_decode(s[3], s[0], s[1], s[2], c, c, 4, 4, scale, BLOCK_SIZE, keys)
            else:
                sets = _contiguous_query_sets(batch, keys, dev)
                fn = _contiguous_decode(c, scale)
            for options in options_list:
                pd.KERNEL_OPTIONS = ("-DFQD_TIMELINE=1", *options.split())
                pd.clear_caches()
                for i in range(6):
                    out, _ = fn(sets[i % len(sets)])
                torch.cuda.synchronize()
                setup = next(iter(pd._LAUNCHES.values()))
                stamps = setup.part_out if setup.plan.splits > 1 else out
                ctas, warps = setup.grid[0] * setup.grid[1] * setup.grid[2], setup.threads // 32
                raw = stamps.reshape(-1).view(torch.int64)[: ctas * warps * 8].reshape(ctas, warps, 8).cpu()
                st = raw.double()  # nanoseconds since the grid's first entry (subtracted in int64: exact)
                st[:, :, :5] = (raw[:, :, :5] - raw[:, :, 0].min()).double() / 1000.0
                per_sm = {}
                for cta, sm in enumerate(st[:, 0, 5].tolist()):
                    per_sm.setdefault(sm, []).append(cta)
                end = st[:, :, 4].max(1).values
                lone = [cta for ctas_on_sm in per_sm.values() if len(ctas_on_sm) == 1 for cta in ctas_on_sm]
                phases = {
                    "entry": st[:, :, 0].min(1).values,
                    "wait": st[:, :, 1].max(1).values - st[:, :, 0].min(1).values,
                    "prologue": st[:, :, 2].max(1).values - st[:, :, 1].max(1).values,
                    "loop per warp": (st[:, :, 3] - st[:, :, 2]).reshape(-1),
                    "warp end spread": st[:, :, 3].max(1).values - st[:, :, 3].min(1).values,
                    "epilogue": end - st[:, :, 3].max(1).values,
                    "CTA end": end,
                }
                print(f"timeline {'paged' if paged else 'contiguous'} B={batch} N={keys} options={options or '-'}: "
                      f"{ctas} CTAs on {len(per_sm)} SMs "
                      f"({len(lone)} alone), span {end.max().item():.2f} us", flush=True)
                for name, values in phases.items():
                    print(f"    {name:<16} min/p50/p90/max {quantiles(values.tolist())} us")
                if lone:
                    print(f"    lone CTAs end at p50 {quantiles(end[lone].tolist()).split('/')[1]} us")
                # The SM's two places: the CTA that entered first and the other one (their loops' last warp).
                loop_end = st[:, :, 3].max(1).values
                pairs = [sorted(v, key=lambda cta: st[cta, :, 0].min().item()) for v in per_sm.values() if len(v) == 2]
                if pairs:
                    first = [loop_end[a].item() for a, _ in pairs]
                    second = [loop_end[b].item() for _, b in pairs]
                    print(f"    loop end, first / second place of {len(pairs)} SMs: mean {sum(first) / len(first):.2f}"
                          f" / {sum(second) / len(second):.2f} us, max {max(first):.2f} / {max(second):.2f} us")
            del sets
            torch.cuda.empty_cache()
    finally:
        pd.KERNEL_OPTIONS, pd.CLUSTER_MERGE = default_options, default_cluster
        pd.clear_caches()


if __name__ == "__main__":
    main()
