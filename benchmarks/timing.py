"""GPU timing helpers shared by every benchmark: CUDA events, warm-up, median, spread, cold L2 by rotation."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

L2_BYTES = 60 * 1024 * 1024  # the H200's L2 is 60 MB; inputs are rotated beyond it
SPIN_CYCLES = 4_000_000  # a ~2 ms GPU spin: long enough for the host to queue every launch of a repetition


def copies_to_exceed_l2(bytes_per_input: int, l2_bytes: int = 2 * L2_BYTES) -> int:
    """How many input sets to rotate through so consecutive runs never hit in L2."""
    return max(1, -(-l2_bytes // max(1, bytes_per_input)) + 1)


def time_ms(
    fns: Sequence[Callable[[], object]] | Callable[[], object],
    reps: int = 50,
    warmup_ms: float = 30.0,
    lead_cycles: int = 0,
) -> float:
    """Median milliseconds of one call, cycling through ``fns`` (one closure per rotated input set).

    With ``lead_cycles`` > 0 a GPU sleep of that many cycles is queued before each timed call, so the host's
    Python and launch overhead runs while the GPU is still busy: device time only (a diagnostic; the official
    numbers keep the host time before the first kernel).
    """
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    calls = 0
    while True:  # time-based warm-up: compile, autotune and clock ramp stay out of the numbers
        fns[calls % len(fns)]()
        calls += 1
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > warmup_ms and calls >= 3:
            break
    times = []
    for i in range(max(reps, 50)):
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def event_ms(fn_of_set: Callable[[object], object], sets: Sequence[object], calls: int = 1, reps: int = 40,
             spin: bool = True) -> float:
    """Median milliseconds per call over ``reps`` repetitions of ``calls`` calls between two CUDA events, repetition
    ``r`` starting at input set ``r`` of ``sets``; three calls per set first (compile, plan, allocate).

    ``spin``: a GPU spin of ``SPIN_CYCLES`` before each repetition, so all its launches are queued before the first
    runs (device time); otherwise the stream is synchronized first and host gaps between the calls count.
    """
    for i in range(3 * len(sets)):
        fn_of_set(sets[i % len(sets)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(reps):
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        else:
            torch.cuda.synchronize()
        start.record()
        for i in range(calls):
            fn_of_set(sets[(r + i) % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / median of repeated measurements."""
    return (max(values) - min(values)) / statistics.median(values)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (GB/s, bytes read + written) measured now: the HBM ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=50)
    return 2 * src.numel() / (ms * 1e-3) / 1e9
