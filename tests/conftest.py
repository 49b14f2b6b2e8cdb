import os
import zlib

import pytest
import torch


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from flashquant_hf.backend import cupy_available

    return cupy_available()


def pytest_collection_modifyitems(config, items):
    for item in items:  # everything under tests/gpu/ is a GPU test
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_threads():
    # Under pytest-xdist the workers share the cores: one thread each keeps them from oversubscribing.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))


@pytest.fixture
def rng_seed(request) -> int:
    """A seed fixed by the test's id: the same on every run and in every xdist worker, different per parameter."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture(autouse=True)
def _seeded_global_rng(rng_seed):
    """What still draws from torch's global RNG (model initialisation, sampling in generate) draws from the test's
    seed, and the state it found is restored: results do not depend on which tests ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        yield


@pytest.fixture
def gen(rng_seed) -> torch.Generator:
    """A CPU generator seeded by the test's id."""
    return torch.Generator().manual_seed(rng_seed)
