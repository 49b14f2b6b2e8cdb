"""The compiled launcher of prepared decode calls (``cuda/decode_launcher.cpp``).

A decode call whose signature (tensor shapes, strides, dtypes, devices and the other arguments) was seen before needs
only its pointers written and its kernels launched. In Python the signature, its lookup, the two output allocations
and the two launches cost more host time than the GPU spends on a short decode; the compiled launcher does the same
work in one C++ call. It is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; no CUDA toolkit) the
first time a decode call is prepared, and every call prepared from then on is registered with it. Until it is built,
or where it cannot be built (said once in the log), the Python launcher
(:class:`~flashquant_hf.kernels.decode_launch.PreparedDecode`) serves.

The compiler runs in a process of its own session, watched by a background thread: a program that ends before the
build does (a short script, a notebook kernel restarted) neither stops it nor leaves the build directory's lock behind,
which would keep every later process from building. A lock older than :data:`STALE_LOCK_S` (its process was killed
mid-build) is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..log import warn_once
from . import loader

logger = logging.getLogger(__name__)

SOURCE = "decode_launcher.cpp"
EXTENSION_NAME = "flashquant_hf_decode_launcher"
ENABLED = True  # False: the Python launcher serves every call (tests compare both)
# Wrapper tags leading a call's values, so two wrappers' signatures never meet.
TQ_DECODE, PAGED_DECODE = 0, 1
STALE_LOCK_S = 600.0  # a build takes well under this; an older lock was left by a process killed mid-build
_LOAD_OPTIONS = {"extra_cflags": ["-O2"], "extra_ldflags": ["-ldl"], "verbose": False}
# What the build process runs: torch's loader with the arguments _build_in_own_session passes (argv[1], JSON), ending
# itself after STALE_LOCK_S (argv[2]) rather than waiting forever on a lock whose holder was killed.
_BUILD_SCRIPT = ("import json, signal, sys; signal.alarm(int(sys.argv[2])); "
                 "from torch.utils.cpp_extension import load; load(**json.loads(sys.argv[1]))")

_module: Any = None
_build_thread: threading.Thread | None = None
_build_lock = threading.Lock()


def module() -> Any:
    """The built launcher, or None (disabled, not built yet, or its build failed)."""
    return _module if ENABLED else None


def _source_path() -> Path:
    path = loader.CUDA_DIR / SOURCE
    if not isinstance(path, Path):  # a wheel's package resource: the zip-safe path of an installed file
        path = Path(str(path))
    return path


def build_directory() -> Path:
    """Where the launcher is built: under torch's extension root (``TORCH_EXTENSIONS_DIR`` where set), one folder per
    source, build arguments, Python and torch version, so a library found there is current."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    key = hashlib.sha256(_source_path().read_bytes())
    key.update(json.dumps([_LOAD_OPTIONS, sys.version, torch.__version__]).encode())
    return Path(root) / f"{EXTENSION_NAME}-{key.hexdigest()[:16]}"


def remove_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock in ``directory`` if it is older than ``max_age_s`` (True when one was removed).

    The lock is first renamed to a name of this thread's own (of processes that found it stale, one gets it), then
    removed only if what was renamed is still stale: a fresh lock that replaced it in between is put back.
    """
    lock = directory / "lock"
    claimed = directory / f"lock.stale-{os.getpid()}-{threading.get_ident()}"

    def stale(path: Path) -> bool:
        return time.time() - path.stat().st_mtime > max_age_s

    try:
        if not stale(lock):
            return False
        os.rename(lock, claimed)
    except FileNotFoundError:
        return False
    removed = stale(claimed)
    if not removed:
        with contextlib.suppress(FileExistsError):  # a third process holds a lock of its own by now
            os.link(claimed, lock)
    claimed.unlink()
    if removed:
        logger.info("flashquant-hf removed a stale build lock of its decode launcher (%s)", lock)
    return removed


def _build_in_own_session(directory: Path) -> None:
    """Build the launcher into ``directory`` by a process of its own session (it outlives a caller that ends)."""
    arguments = {"name": EXTENSION_NAME, "sources": [str(_source_path())], "build_directory": str(directory),
                 **_LOAD_OPTIONS}
    log = directory / f"build-{os.getpid()}.log"
    with open(log, "w") as output:
        command = [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(arguments), str(int(STALE_LOCK_S))]
        built = subprocess.run(command, cwd=directory, stdin=subprocess.DEVNULL, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
    if built.returncode:
        raise RuntimeError(f"the build process exited with status {built.returncode}, see {log}")
    log.unlink()


def _import_library(library: Path) -> Any:
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, library)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    return launcher


def _build() -> None:
    global _module
    try:
        directory = build_directory()  # imports torch, whose libraries the launcher links against
        library = directory / f"{EXTENSION_NAME}.so"
        if not library.exists() or (directory / "lock").exists():  # a build under way may not have written it all
            directory.mkdir(parents=True, exist_ok=True)
            remove_stale_lock(directory)
            _build_in_own_session(directory)
        _module = _import_library(library)
    except Exception as error:  # no compiler, no ninja, no Python headers: the Python launcher serves
        warn_once(logger, f"flashquant-hf could not build its compiled decode launcher ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); decode calls launch "
                          "from Python")


def start_build() -> None:
    """Build the launcher (a build process watched by a background thread, once per process)."""
    global _build_thread
    if not ENABLED or _build_thread is not None:  # the common case, without the lock (prepared calls ask each time)
        return
    with _build_lock:
        if _build_thread is None:
            _build_thread = threading.Thread(target=_build, name="flashquant-decode-launcher", daemon=True)
            _build_thread.start()


def wait(timeout: float | None = None) -> Any:
    """Start the build if needed and wait for it; returns :func:`module`."""
    start_build()
    thread = _build_thread
    if thread is not None:
        thread.join(timeout)
    return module()


def _launch_spec(launch: loader.PreparedLaunch) -> tuple:
    return (launch.function, launch.grid, launch.block, launch.shared_mem, launch.block_args.buffer.raw,
            list(launch.slots))


def remember(tensors: tuple, values: tuple, prepared: Any, alignment: tuple[int, ...],
             out_shape: tuple[int, ...], lse_shape: tuple[int, ...], programmatic: bool) -> bool:
    """Register a checked call with the launcher (once it is built): ``tensors`` in the order of the decode's pointer
    arguments (None for an absent one), ``values`` the call's other arguments led by its wrapper tag, ``prepared``
    its :class:`~flashquant_hf.kernels.decode_launch.PreparedDecode`, ``alignment`` the byte alignment each tensor's
    address needs. False when there is no launcher yet (the build is then started), else True (registered, or left
    to the Python launcher for values the compiled one does not key on)."""
    launcher = module()
    if launcher is None:
        start_build()
        return False
    merge = None if prepared.merge is None else _launch_spec(prepared.merge)
    workspace = [] if prepared.workspace is None else list(prepared.workspace)
    try:
        launcher.remember(list(tensors), values, prepared.decode.device_index, _launch_spec(prepared.decode), merge,
                          workspace, list(alignment), list(out_shape), list(lse_shape), programmatic)
    except (TypeError, ValueError):  # values it does not key on (e.g. NumPy integers): the Python launcher serves
        pass
    return True


def clear() -> None:
    """Forget every registered call."""
    if _module is not None:
        _module.clear()
