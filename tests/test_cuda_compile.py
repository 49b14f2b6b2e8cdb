"""Compile every CUDA kernel instantiation with nvcc, on CPU-only CI.

Convention for kernel wrappers: every module ``flashquant_hf/kernels/<op>.py`` that launches kernels declares

* ``CUDA_SOURCE = "<file>.cu"``: the source under ``cuda/`` it compiles (through ``loader.get_kernel``);
* ``NAME_EXPRESSIONS``: every template instantiation it may launch, e.g.
  ``"tq_compress_hadamard<128, 4, __nv_bfloat16>"`` (an empty tuple for a pure dispatcher such as
  ``tq_attention.py``, which this test then skips);
* optionally ``HOPPER_ONLY = True`` when its source uses sm_90a-only instructions (wgmma, setmaxnreg) behind
  ``#if defined(__CUDA_ARCH_FEAT_SM90_ALL)``; it is then also compiled for sm_90a;
* instead of ``NAME_EXPRESSIONS``, a module whose launches compile with NVRTC options (``-D`` build switches)
  declares ``BUILDS``: ``(options, name expressions)`` pairs, every build it may compile on any GPU.

For each build this test writes one translation unit: ``loader.cuda_source(CUDA_SOURCE)`` (local headers
inlined, exactly the text NVRTC receives) followed by a host array that takes the address of every name
expression of the build, which makes nvcc instantiate and compile each one:

    void* fq_instances[] = {(void*)&tq_compress_hadamard<128, 4, __nv_bfloat16>, ...};

and compiles it with ``nvcc -std=c++17 -c -arch=sm_80`` and ``-arch=sm_90`` plus the build's options (all
invocations of a source run in parallel; about a minute of CPU per build). Skipped, with the reason, when nvcc
is not on PATH.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import flashquant_hf.kernels as kernels_pkg
from flashquant_hf.kernels import loader

NVCC = shutil.which("nvcc")
ARCHS = ("sm_80", "sm_90")


def _kernel_modules():
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        if info.name == "loader":
            continue
        yield importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")


def _sources() -> dict[str, dict]:
    """CUDA source -> {"builds": {options: [names]}, "hopper": bool, "modules": [...]}, from every wrapper's table."""
    sources: dict[str, dict] = {}
    for module in _kernel_modules():
        names = tuple(getattr(module, "NAME_EXPRESSIONS", ()))
        builds = tuple(getattr(module, "BUILDS", ()))
        if names:
            builds += (((), names),)
        if not builds:
            continue
        source = getattr(module, "CUDA_SOURCE", None)
        assert isinstance(source, str) and source.endswith(".cu"), (
            f"{module.__name__} has NAME_EXPRESSIONS or BUILDS but no CUDA_SOURCE = '<file>.cu' naming its source"
        )
        entry = sources.setdefault(source, {"builds": {}, "hopper": False, "modules": []})
        for options, build_names in builds:
            known = entry["builds"].setdefault(tuple(options), [])
            known += [n for n in build_names if n not in known]
        entry["hopper"] |= bool(getattr(module, "HOPPER_ONLY", False))
        entry["modules"].append(module.__name__)
    return sources


SOURCES = _sources()


def _translation_unit(source: str, names: list[str]) -> str:
    addresses = ",\n".join(f"    (void*)&{name}" for name in names)
    return (f"{loader.cuda_source(source)}\n\n// Host side: taking each address instantiates it.\n"
            f"void* fq_instances[] = {{\n{addresses}\n}};\n")


def _nvcc(tu: Path, arch: str, options: tuple[str, ...] = ()) -> tuple[str, int, str]:
    cmd = [NVCC, "-std=c++17", "-c", f"-arch={arch}", *options, str(tu), "-o", os.devnull]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return " ".join((arch, *options)), proc.returncode, proc.stdout + proc.stderr


def test_every_wrapper_declares_its_source():
    """Wrappers with instantiations name an existing source; the compress/decompress tables are complete."""
    assert "compress.cu" in SOURCES and "decompress.cu" in SOURCES
    for source in SOURCES:
        assert (loader.CUDA_DIR / source).is_file(), f"cuda/{source} does not exist"
    from flashquant_hf.kernels import compress, decompress

    assert len(compress.NAME_EXPRESSIONS) == len(compress.ROTATION_PATHS) * len(compress.SUPPORTED)
    assert len(decompress.NAME_EXPRESSIONS) == len(decompress.KERNELS) * len(compress.SUPPORTED)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: cannot compile the CUDA kernels here")
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_cuda_source_compiles(source):
    entry = SOURCES[source]
    archs = ARCHS + (("sm_90a",) if entry["hopper"] else ())
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (options, names) in enumerate(entry["builds"].items()):
            tu = Path(tmp) / f"check_{Path(source).stem}_{i}.cu"
            tu.write_text(_translation_unit(source, names))
            jobs += [(tu, arch, options) for arch in archs]
        with ThreadPoolExecutor(max_workers=len(archs)) as pool:
            results = list(pool.map(lambda job: _nvcc(*job), jobs))
    failures = [f"--- nvcc -arch={arch} (exit {rc}):\n{log[-6000:]}" for arch, rc, log in results if rc != 0]
    assert not failures, f"cuda/{source} ({', '.join(entry['modules'])}) failed to compile:\n" + "\n".join(failures)


def test_fast_divider_matches_integer_division(rng_seed):
    """The host-side magic numbers the kernels divide row indices with (multiply-high, add, shift)."""
    from flashquant_hf.kernels.compress import fast_divider

    rng = np.random.default_rng(rng_seed)
    edges = [1, 2, 3, 7, 37, 64, 97, 1000, 4099, 65535, 2**20 + 7, 2**30, 2**31 - 1]
    for divisor in [*edges, *rng.integers(1, 2**31, 20)]:
        d, magic, shift = fast_divider(int(divisor))
        n = np.concatenate([rng.integers(0, 2**31, 5000), [0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 1]])
        n = n.astype(np.uint64)
        q = (((n * np.uint64(magic)) >> np.uint64(32)) + n) >> np.uint64(shift)
        assert np.array_equal(q, n // np.uint64(d)), f"divisor {divisor}"
    with pytest.raises(ValueError):
        fast_divider(0)


def test_collapse_rows_merges_only_uniform_dims():
    from flashquant_hf.kernels.compress import collapse_rows

    # The cache view [B, H, :N] of [B, H, N_cap, 64] bytes and of [B, H, N_cap] norms: B and H merge.
    assert collapse_rows([2, 8, 10], [8 * 32 * 64, 32 * 64, 64], [8 * 32, 32, 1]) == (
        [1, 16, 10], [[0, 32 * 64, 64], [0, 32, 1]]
    )
    # HF's transposed [B, L, H, D] -> [B, H, L, D]: nothing merges.
    assert collapse_rows([2, 8, 10], [10 * 8 * 128, 128, 8 * 128]) == ([2, 8, 10], [[10240, 128, 1024]])
    assert collapse_rows([2, 1, 3, 5], [15, 99, 5, 1]) == ([1, 1, 30], [[0, 0, 1]])
    assert collapse_rows([2, 3, 5, 7], [1, 2, 6, 30]) is None


def test_launch_config_structs_follow_the_driver_abi():
    """cuLaunchKernelEx reads these structs by offset (cuda.h, CUDA 12/13 on 64-bit Linux): CUlaunchAttribute is
    an int id, 4 bytes of padding and a 64-byte value union; CUlaunchConfig puts the stream after 7 uints."""
    import ctypes

    assert ctypes.sizeof(loader._LaunchAttribute) == 72
    assert loader._LaunchAttribute.value.offset == 8
    assert loader._LaunchConfig.shared_mem.offset == 24
    assert loader._LaunchConfig.stream.offset == 32
    assert loader._LaunchConfig.attrs.offset == 40
    assert loader._LaunchConfig.num_attrs.offset == 48
    attribute = loader._LaunchAttribute(id=6)
    attribute.value.flag = 1
    raw = bytes(attribute)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")


class _FakeDriver:
    """Records what cuLaunchKernelEx is given (grid, block, shared memory, stream, attributes) and answers `status`."""

    def __init__(self, status=0):
        self.status, self.seen = status, []

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = config_ref._obj
        attrs = [(config.attrs[i].id, config.attrs[i].value.flag) for i in range(config.num_attrs)]
        self.seen.append(((config.grid_x, config.grid_y, config.grid_z), config.block_x, config.shared_mem,
                          config.stream, attrs, function, params))
        return self.status


def test_programmatic_launch_passes_each_calls_grid_and_stream(monkeypatch):
    """The launch configuration is built once per kernel and rewritten per call: the driver sees this call's grid,
    block, shared memory and stream, one programmatic-serialization attribute, and the parameter array."""
    driver = _FakeDriver()
    monkeypatch.setattr(loader, "_driver", lambda: driver)
    block_args = loader.ArgBlock((np.int64(1),))
    assert loader._launch_programmatic(block_args, 11, (3, 2, 1), 256, 4096, 77, 1234)
    assert loader._launch_programmatic(block_args, 11, (5, 1, 8), 128, 0, 78, 1234)
    programmatic = [(6, 1)]
    assert driver.seen == [((3, 2, 1), 256, 4096, 77, programmatic, 11, 1234),
                           ((5, 1, 8), 128, 0, 78, programmatic, 11, 1234)]
    for refusal in (201, 1):  # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE: the caller launches plainly
        monkeypatch.setattr(loader, "_driver", lambda refusal=refusal: _FakeDriver(refusal))
        assert not loader._launch_programmatic(block_args, 11, (1, 1, 1), 32, 0, 0, 0)
    monkeypatch.setattr(loader, "_driver", lambda: None)
    assert not loader._launch_programmatic(block_args, 11, (1, 1, 1), 32, 0, 0, 0)
