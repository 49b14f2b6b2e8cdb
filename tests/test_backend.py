import pytest
import torch

from flashquant_hf import ops
from flashquant_hf.backend import resolve_backend


def test_auto_uses_the_reference_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BACKEND", "auto")
    assert resolve_backend(torch.zeros(1)) == "torch"
    assert ops.implementation("compress", torch.zeros(1)).__name__ == "flashquant_hf.reference.compress"


def test_torch_backend_forces_the_reference(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BACKEND", "torch")
    assert resolve_backend(torch.zeros(1)) == "torch"


def test_cuda_backend_without_cuda_tensors_raises_clearly(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="FLASHQUANT_BACKEND=cuda needs every tensor on a CUDA device"):
        resolve_backend(torch.zeros(1))


def test_unknown_backend_raises(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BACKEND", "tpu")
    with pytest.raises(ValueError, match="FLASHQUANT_BACKEND"):
        resolve_backend(torch.zeros(1))
