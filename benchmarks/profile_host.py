"""Host time of one contiguous decode call (``tq_decode``) through the Python launcher and of its pieces, on the GPU
machine (the compiled launcher, ``kernels/decode_launcher.py``, is off here).

    python benchmarks/profile_host.py [--out DIR]

Each figure is the median over rounds of 20 calls back to back (the stream drained between rounds, so no round
waits on a full launch queue), in microseconds of host time: the whole prepared call, then each piece it is made of
(the signature of the call and its lookup, the two output allocations, the pointer reads, the decode launch and the
merge launch through their prepared parameter arrays). Writes ``host/<date>_<commit>.json`` under ``--out``
(default: ``benchmarks/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import HEAD_DIM, Q_HEADS, _centroids, _contiguous_set, _cpu_us_per_call  # noqa: E402
from benchmarks.run_gpu import _commit  # noqa: E402

SHAPES = ((8, 32768, "b8_n32k"), (1, 131072, "b1_n128k"))
WIDTHS = ((4, 4), (3, 3))


def host_us(fn) -> float:
    """Median host time per call over rounds of 20 calls (bench_decode's measurement of one call's host time)."""
    return _cpu_us_per_call(lambda _: fn(), [None], rounds=41)


def profile(batch: int, keys: int, k_bits: int, v_bits: int) -> dict:
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels import decode_launcher

    decode_launcher.ENABLED = False  # the pieces of the Python launcher's prepared call
    from flashquant_hf.kernels.tq_decode import tq_decode

    dev = torch.device("cuda")
    ck, cv = _centroids(dev, k_bits), _centroids(dev, v_bits)
    kp, kn, vp, vn = _contiguous_set(batch, keys, dev, 0, k_bits, v_bits)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    tensors = (q, kp, kn, vp, vn, ck, cv, None)
    tq_decode(q, kp, kn, vp, vn, ck, cv, k_bits, v_bits, scale)
    signature = dl.call_signature("tq_decode", tensors, k_bits, v_bits, scale)
    prepared = dl.prepared_call(signature).launch
    out = torch.empty(batch, Q_HEADS, 1, HEAD_DIM, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, Q_HEADS, 1, dtype=torch.float32, device=dev)
    inputs = tuple(t.data_ptr() for t in tensors if t is not None)
    pointers = (*inputs, out.data_ptr(), lse.data_ptr())
    figures = {
        "splits": prepared.decode.grid[0],
        "launches": 1 if prepared.merge is None else 2,
        "call_us": host_us(lambda: tq_decode(q, kp, kn, vp, vn, ck, cv, k_bits, v_bits, scale)),
        "signature_us": host_us(lambda: dl.call_signature("tq_decode", tensors, k_bits, v_bits, scale)),
        "lookup_us": host_us(lambda: dl.prepared_call(signature)),
        "outputs_us": host_us(lambda: (
            torch.empty(batch, Q_HEADS, 1, HEAD_DIM, dtype=torch.float32, device=dev),
            torch.empty(batch, Q_HEADS, 1, dtype=torch.float32, device=dev))),
        "pointers_us": host_us(lambda: tuple(t.data_ptr() for t in tensors if t is not None)),
        "launches_us": host_us(lambda: prepared(inputs, out.data_ptr(), lse.data_ptr())),
    }
    if prepared.merge is None:
        figures["decode_launch_us"] = host_us(lambda: prepared.decode(pointers, True))
    else:
        figures["decode_launch_us"] = host_us(lambda: prepared.decode(inputs, True))
        figures["merge_launch_us"] = host_us(lambda: prepared.merge((out.data_ptr(), lse.data_ptr()), True))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    results = {}
    for k_bits, v_bits in WIDTHS:
        for batch, keys, tag in SHAPES:
            name = f"k{k_bits}v{v_bits}_{tag}"
            results[name] = profile(batch, keys, k_bits, v_bits)
            print(name, {k: round(v, 2) for k, v in results[name].items()}, flush=True)
    commit = _commit()
    doc = {"date": datetime.date.today().isoformat(), "commit": commit, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "cpu_count": os.cpu_count(), "results": results}
    path = Path(args.out) / "host" / f"{doc['date']}_{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
