"""The compiled decode launcher (``cuda/decode_launcher.cpp``) builds with torch's C++ extension tooling and keys
registered calls on everything a call's validity depends on: each tensor's rank, sizes, strides, dtype and device
(None apart), and the other arguments with their types. GPU behaviour: tests/gpu/test_decode_launcher.py."""

import os
import subprocess
import sys
import time

import pytest
import torch

from flashquant_hf.kernels import decode_launcher


@pytest.fixture(scope="module")
def launcher():
    module = decode_launcher.wait(300)
    assert module is not None, "the compiled decode launcher did not build (C++ compiler and ninja are required)"
    return module


def spec(words: int = 6, slots=(0, 1, 4, 5)) -> tuple:
    """A launch spec (function, grid, block, shared memory, parameter bytes, pointer slots); never launched here."""
    return (0, (1, 1, 1), 32, 0, bytes(8 * words), list(slots))


def remember(launcher, tensors, values, alignment=None):
    alignment = [1] * len(tensors) if alignment is None else alignment
    slots = range(sum(t is not None for t in tensors) + 2)  # one per tensor, two for the outputs
    launcher.remember(list(tensors), values, 0, spec(slots=slots), None, [], alignment, [1, 2], [1], False)


def test_signature_keys_on_metadata_and_value_types(launcher):
    launcher.clear()
    base = torch.zeros(4, 8)
    tensors, values = (base, None, torch.zeros(3, dtype=torch.uint8)), (0, 4, 4, 0.5)
    remember(launcher, tensors, values)
    remember(launcher, (torch.ones(4, 8), None, torch.ones(3, dtype=torch.uint8)), (0, 4, 4, 0.5))
    assert launcher.size() == 1, "same metadata and values must share a registration"
    variants = [
        ((torch.zeros(8, 4), None, tensors[2]), values),  # sizes
        ((torch.zeros(8, 4).t(), None, tensors[2]), values),  # strides (same sizes)
        ((base.double(), None, tensors[2]), values),  # dtype
        ((base, tensors[2], tensors[2]), values),  # None vs a tensor
        ((base.unsqueeze(0), None, tensors[2]), values),  # rank
        (tensors, (0, 4, 4, 0.25)),  # a value
        (tensors, (0, 4, 4, 1)),
        (tensors, (0, 4, 4, 1.0)),  # float vs int
        (tensors, (0, 1, 4, 0.5)),
        (tensors, (0, True, 4, 0.5)),  # bool vs int
        (tensors, (1, 4, 4, 0.5)),  # the wrapper tag
    ]
    for count, (t, v) in enumerate(variants, start=2):
        remember(launcher, t, v)
        assert launcher.size() == count, f"variant {count - 2} should have its own registration"
    launcher.clear()
    assert launcher.size() == 0


def test_unregistered_calls_and_malformed_registrations(launcher):
    launcher.clear()
    assert launcher.run([torch.zeros(2), None], (0, 4, 4, 0.5)) is None
    with pytest.raises(ValueError, match="one alignment per tensor"):
        launcher.remember([torch.zeros(2)], (0,), 0, spec(), None, [], [1, 1], [1], [1], False)
    with pytest.raises(ValueError, match="pointer slot out of range"):
        launcher.remember([torch.zeros(2)], (0,), 0, spec(slots=(0, 9)), None, [], [1], [1], [1], False)
    with pytest.raises(ValueError, match="bools, ints or floats"):
        launcher.remember([torch.zeros(2)], ("x",), 0, spec(slots=(0, 1, 2)), None, [], [1], [1], [1], False)
    with pytest.raises(RuntimeError, match="a pointer slot per tensor and two for its outputs"):
        launcher.remember([torch.zeros(2), None], (0,), 0, spec(slots=(0, 1, 2, 3)), None, [], [1, 1], [1], [1], False)
    partials = [torch.zeros(2), torch.zeros(2)]
    with pytest.raises(RuntimeError, match="the merge launch takes four pointers"):
        launcher.remember([torch.zeros(2)], (0,), 0, spec(slots=(0, 1, 2)), spec(slots=(0, 1, 2)), partials, [1], [1],
                          [1], False)
    assert launcher.size() == 0, "a failed registration registers nothing"


def test_disabled_launcher_serves_nothing(launcher, monkeypatch):
    from flashquant_hf.kernels import decode_launch as dl

    monkeypatch.setattr(decode_launcher, "ENABLED", False)
    assert dl.compiled_launcher() is None
    assert dl.run_compiled((torch.zeros(1),), (0,)) is None
    monkeypatch.setattr(decode_launcher, "ENABLED", True)
    monkeypatch.setattr(dl, "FAST_LAUNCH", False)
    assert dl.compiled_launcher() is None


def test_a_program_ending_mid_build_leaves_a_launcher_for_the_next(tmp_path):
    """A process that starts the build and ends seconds later (before the compiler does) neither stops the build
    nor leaves its lock: the next process loads the launcher."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    start = ("import time; from flashquant_hf.kernels import decode_launcher as d; d.start_build(); time.sleep(1); "
             "assert d.module() is None, 'built within a second: the test needs a longer build'")
    subprocess.run([sys.executable, "-c", start], env=env, check=True, timeout=120)
    load = "from flashquant_hf.kernels import decode_launcher as d; print(d.wait(300) is not None)"
    loaded = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=400)
    assert loaded.stdout.strip() == "True", loaded.stderr
    (directory,) = tmp_path.iterdir()
    assert not (directory / "lock").exists()


def test_only_a_stale_build_lock_is_removed(tmp_path):
    lock = tmp_path / "lock"
    assert not decode_launcher.remove_stale_lock(tmp_path), "no lock"
    lock.touch()
    assert not decode_launcher.remove_stale_lock(tmp_path) and lock.exists(), "a build under way keeps its lock"
    old = time.time() - decode_launcher.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert decode_launcher.remove_stale_lock(tmp_path) and not lock.exists()
    assert [f.name for f in tmp_path.iterdir()] == []


def test_a_fresh_lock_that_replaced_a_stale_one_is_kept(tmp_path, monkeypatch):
    """Another process removes the stale lock and takes a fresh one between this process's age check and its
    removal: the fresh lock stays, with its content."""
    lock = tmp_path / "lock"
    lock.write_text("stale")
    old = time.time() - decode_launcher.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    rename = os.rename

    def replaced_first(source, target):
        lock.unlink()
        lock.write_text("fresh")
        rename(source, target)

    monkeypatch.setattr(decode_launcher.os, "rename", replaced_first)
    assert not decode_launcher.remove_stale_lock(tmp_path)
    assert lock.read_text() == "fresh"
    assert [f.name for f in tmp_path.iterdir()] == ["lock"]


def test_a_failed_build_is_logged_with_its_log_and_leaves_the_python_launcher(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false"}  # a compiler that always fails
    load = "from flashquant_hf.kernels import decode_launcher as d; print(d.wait(300) is None)"
    loaded = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=400)
    assert loaded.stdout.strip() == "True", loaded.stderr
    assert "could not build its compiled decode launcher" in loaded.stderr
    (log,) = tmp_path.glob("*/build-*.log")
    assert str(log) in loaded.stderr and log.read_text().strip(), "the warning names the build's own log"
    assert not list(tmp_path.glob("*/*.so"))
