"""Compare the SASS of every production kernel build between a git revision and the working tree.

    python tools/sass_diff.py [REV]        (default REV: HEAD)

For a change that must not alter the kernels (a clean-up, a comment, a rename in Python): every build the kernel
wrappers declare (``BUILDS``, or ``NAME_EXPRESSIONS`` without options) is compiled with ``nvcc -cubin -std=c++17``
for sm_80 and sm_90a from the working tree's ``cuda/`` and from REV's, and each kernel's SASS (instructions and
their encodings, from ``cuobjdump -sass``) and resource usage (``cuobjdump -res-usage``) are compared. Sources and
kernels are matched by name, so a rename shows as missing kernels. Needs nvcc, and cuobjdump with nvdisasm on PATH
(``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``). Not run by CI. Exit status 1 when anything differs.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90a")
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def builds() -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(source, options, name expressions) of every build the working tree's kernel wrappers declare."""
    sys.path.insert(0, str(ROOT))
    import flashquant_hf.kernels as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names = tuple(getattr(module, "NAME_EXPRESSIONS", ()))
        for options, build_names in tuple(getattr(module, "BUILDS", ())) + ((((), names),) if names else ()):
            found.append((module.CUDA_SOURCE, tuple(options), tuple(build_names)))
    return found


def inline(cuda_dir: Path, name: str, seen: frozenset[str] = frozenset()) -> str:
    """``cuda_dir/name`` with its local includes inlined, as kernels/loader.py does."""
    seen = seen | {name}
    return _INCLUDE.sub(lambda m: "" if m.group(1) in seen else inline(cuda_dir, m.group(1), seen),
                        (cuda_dir / name).read_text())


def sass(cuda_dir: Path, source: str, arch: str, options: tuple[str, ...], names: tuple[str, ...]) -> dict:
    """{mangled kernel name: (SASS lines, resource usage)} of one build."""
    with tempfile.TemporaryDirectory() as tmp:
        unit, cubin = Path(tmp) / "unit.cu", Path(tmp) / "unit.cubin"
        addresses = ",\n".join(f"    (void*)&{name}" for name in names)
        unit.write_text(f"{inline(cuda_dir, source)}\nvoid* fq_instances[] = {{\n{addresses}\n}};\n")
        subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", *options, str(unit), "-o", str(cubin)],
                       check=True, capture_output=True)
        listing = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True)
        usage = subprocess.run(["cuobjdump", "-res-usage", str(cubin)], check=True, capture_output=True, text=True)
    kernels: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.stdout.splitlines():
        if match := re.match(r"\s*Function : (\S+)", line):
            current = kernels.setdefault(match.group(1), [])
        elif "/*" in line:
            current.append(line.strip())
    resources = dict(re.findall(r"Function (\S+):\n\s*(.*)", usage.stdout))
    return {name: (lines, resources.get(name, "")) for name, lines in kernels.items()}


def main(rev: str = "HEAD") -> int:
    jobs = [(arch, *build) for build in builds() for arch in ARCHS]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cuda"], check=True, capture_output=True)
        tarfile.open(fileobj=BytesIO(archive.stdout)).extractall(tmp)
        trees = {"working tree": ROOT / "cuda", rev: Path(tmp) / "cuda"}

        def compare(job):
            arch, source, options, names = job
            label = f"{source} {arch} {' '.join(options)}".strip()
            new = sass(trees["working tree"], source, arch, options, names)
            try:
                old = sass(trees[rev], source, arch, options, names)
            except (OSError, subprocess.CalledProcessError) as error:  # renamed source or kernel, other options
                return len(new), [f"{label}: does not build at {rev} ({type(error).__name__})"]
            changed = [name for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
            return len(new), [f"{label}: {name}" for name in changed]

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            results = list(pool.map(compare, jobs))
    differ = [line for _, lines in results for line in lines]
    print(f"{sum(n for n, _ in results)} kernels in {len(jobs)} builds compared with {rev}: {len(differ)} differ")
    for line in differ:
        print("  differs:", line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
