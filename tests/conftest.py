import os

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
