import pytest
import torch

from .poison import poison as poison_fill


@pytest.fixture
def poison():
    """Fill a tensor with a value no kernel writes before a launch (see ``poison.poison``)."""
    return poison_fill


@pytest.fixture
def cuda_gen(rng_seed) -> torch.Generator:
    """A CUDA generator seeded by the test's id."""
    return torch.Generator(device="cuda").manual_seed(rng_seed)


@pytest.fixture
def exact_fp32_matmul():
    """TF32 off for the test (the references rotate with fp32 matmuls), the caller's setting restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.fixture(autouse=True)
def python_launcher_unless_asked(monkeypatch):
    """Decode calls launch from Python unless a test asks for the compiled launcher (tests/gpu/test_decode_launcher.py):
    the other tests poison outputs through ``torch.empty``, which the compiled launcher does not call."""
    from flashquant_hf.kernels import decode_launcher

    monkeypatch.setattr(decode_launcher, "ENABLED", False)
