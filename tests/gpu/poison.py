"""Poisoned buffers: values no kernel writes, so an element a kernel leaves unwritten fails the comparison after it."""

import contextlib

import pytest
import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floating point), 0xAB (bytes) or the type's smallest value (other integers)."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(0xAB if t.dtype == torch.uint8 else torch.iinfo(t.dtype).min)


@contextlib.contextmanager
def poisoned_allocations():
    """Every ``torch.empty`` inside the block hands out a poisoned buffer (outputs, workspaces, partial results)."""
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
        yield
