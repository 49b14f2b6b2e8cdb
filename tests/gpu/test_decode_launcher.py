"""GPU tests of the compiled decode launcher (``kernels/decode_launcher.py``, ``cuda/decode_launcher.cpp``): calls of a
registered signature launch from C++ and give the reference's results for every pointer they are passed; outputs
are poisoned through a memory pool whose free blocks hold NaN; what the build assumed is still checked."""

import contextlib

import pytest
import torch

from .decode_helpers import DEV, centroids
from .test_paged_decode import check as check_paged
from .test_paged_decode import random_store
from .test_tq_decode import check, random_cache


@pytest.fixture
def compiled(monkeypatch):
    """The compiled launcher enabled and built, every cached plan and registration cleared around the test; the
    Python launcher's prepared path raises, so a test sees which launcher served."""
    from flashquant_hf.kernels import decode_launch as dl
    from flashquant_hf.kernels import decode_launcher

    monkeypatch.setattr(decode_launcher, "ENABLED", True)
    assert decode_launcher.wait(300) is not None, "the compiled decode launcher did not build"
    dl.clear_caches()
    yield decode_launcher
    dl.clear_caches()


@contextlib.contextmanager
def poisoned_outputs(*shapes):
    """Allocations inside come from a fresh memory pool whose free blocks (four of each fp32 shape) hold NaN; yields
    the list the caller appends its outputs to, whose addresses are checked to lie in those blocks."""
    pool = torch.cuda.MemPool()
    ranges, outputs = [], []
    with torch.cuda.use_mem_pool(pool):
        seeded = [torch.full(s, float("nan"), device=DEV) for s in shapes for _ in range(4)]
        torch.cuda.synchronize()
        ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in seeded]
        del seeded
        yield outputs
    for t in outputs:
        first, last = t.data_ptr(), t.data_ptr() + t.numel() * 4 - 1
        for address in (first, last):
            assert any(lo <= address < hi for lo, hi in ranges), "an output was not allocated from the poisoned pool"


def python_prepared_path_raises(monkeypatch, module):
    def refuse(*args, **kwargs):
        raise AssertionError("the Python launcher served a call the compiled launcher had registered")

    monkeypatch.setattr(module, "run_prepared", refuse)


@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (3, 2), (2, 2)])
@pytest.mark.parametrize("num_keys,batch,group", [(5000, 2, 4), (300, 2, 8), (4133, 3, 1)])
def test_compiled_tq_decode_follows_every_pointer(bits, num_keys, batch, group, compiled, monkeypatch, cuda_gen):
    """After one call of a signature, later calls over other caches, queries and centroids launch from C++ and
    each gives its own reference result (several splits with the merge, and one split)."""
    import flashquant_hf.kernels.tq_decode as tqd

    kv_heads, head_dim = 2, 128
    caches = [random_cache(batch, kv_heads, num_keys, head_dim, capacity_extra=11, seed=70 + i, k_bits=bits[0],
                           v_bits=bits[1]) for i in range(3)]
    books = [(centroids(head_dim, bits[0]) * s, centroids(head_dim, bits[1]) * s) for s in (1.0, 0.5)]
    q_first = torch.randn(batch, kv_heads * group, 1, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    tqd.tq_decode(q_first, *caches[0], *books[0], *bits, head_dim**-0.5)  # prepares and registers the signature
    assert compiled.module().size() == 1
    with monkeypatch.context() as patched:
        python_prepared_path_raises(patched, tqd)
        for i, cache in enumerate(caches * 2):
            q = torch.randn(batch, kv_heads * group, 1, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
            kc, vc = books[i % 2]
            with poisoned_outputs((batch, kv_heads * group, 1, head_dim), (batch, kv_heads * group, 1)) as outputs:
                result = tqd.tq_decode(q, *cache, kc, vc, *bits, head_dim**-0.5)
                outputs.extend(result)
                torch.cuda.synchronize()
            check(result, q, cache, kc, vc, bits=bits)


def test_compiled_paged_decode_follows_every_pointer(compiled, monkeypatch, cuda_gen):
    import flashquant_hf.kernels.paged_decode as pd

    bits, block_size, kv_heads, head_dim = (3, 3), 16, 2, 128
    lens = [3000, 17, 1200]
    stores = [random_store(lens, block_size, kv_heads, head_dim, seed=90 + i, k_bits=3, v_bits=3) for i in range(2)]
    kc, vc = centroids(head_dim, 3), centroids(head_dim, 3)
    max_len = max(lens)
    q0 = torch.randn(len(lens), 8, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    pd.paged_decode(q0, *stores[0], kc, vc, *bits, head_dim**-0.5, block_size, max_len)
    assert compiled.module().size() == 1
    with monkeypatch.context() as patched:
        python_prepared_path_raises(patched, pd)
        for store in stores * 2:
            q = torch.randn(len(lens), 8, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
            with poisoned_outputs((len(lens), 8, head_dim), (len(lens), 8)) as outputs:
                result = pd.paged_decode(q, *store, kc, vc, *bits, head_dim**-0.5, block_size, max_len)
                outputs.extend(result)
                torch.cuda.synchronize()
            check_paged(q, *store, block_size, max_len, bits=bits, result=result)


def test_compiled_launcher_still_rejects_misaligned_codes(compiled, cuda_gen):
    """A registered signature does not skip the alignment the build assumed: the same shapes and strides at an
    address the loads cannot take get the wrapper's error."""
    from flashquant_hf.kernels.tq_decode import tq_decode

    k, kn, v, vn = random_cache(1, 2, 40, 128)
    c = centroids(128)
    q = torch.randn(1, 4, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    tq_decode(q, k, kn, v, vn, c, c, 4, 4, 0.1)
    assert compiled.module().size() == 1
    flat = torch.zeros(k.numel() + 8, dtype=torch.uint8, device=DEV)
    shifted = flat[8:].view(1, 2, 40, 64)
    assert shifted.stride() == k.stride() and shifted.data_ptr() % 16 == 8
    with pytest.raises(ValueError, match="`k_packed` needs a contiguous last dimension and 16-byte aligned rows"):
        tq_decode(q, shifted, kn, v, vn, c, c, 4, 4, 0.1)


def test_compiled_launcher_under_graph_capture(compiled, cuda_gen):
    """A registered call captured in a CUDA graph (ordinary launches inside the capture) replays with the query
    rewritten in place, equal to an eager call."""
    from flashquant_hf.kernels.tq_decode import tq_decode

    bits = (3, 3)
    cache = random_cache(2, 2, 3000, 128, seed=5, k_bits=3, v_bits=3)
    c = centroids(128, 3)
    q = torch.randn(2, 8, 1, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    tq_decode(q, *cache, c, c, *bits, 128**-0.5)
    assert compiled.module().size() == 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tq_decode(q, *cache, c, c, *bits, 128**-0.5)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tq_decode(q, *cache, c, c, *bits, 128**-0.5)
    q.copy_(torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=cuda_gen))
    graph.replay()
    torch.cuda.synchronize()
    eager = tq_decode(q, *cache, c, c, *bits, 128**-0.5)
    torch.testing.assert_close(captured[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(captured[1], eager[1], rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 3])
def test_model_logits_identical_with_either_launcher(bits, compiled, monkeypatch, cuda_gen):
    """A TurboQuantCache model's teacher-forced decode logits (left-padded batch: the key-bias build) are bitwise
    the same whether the prepared decode calls launch from C++ or from Python: same kernels, plans and inputs."""
    from flashquant_hf import TurboQuantCache
    from flashquant_hf.cache import cache_kwargs

    from .test_hf_gpu import _tiny_llama

    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    model = _tiny_llama(128)
    ids = torch.randint(0, 512, (2, 260), device=DEV, generator=cuda_gen)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0

    @torch.no_grad()
    def logits():
        cache = TurboQuantCache(bits=bits, residual_length=0)
        out = model(ids[:, :200], attention_mask=mask[:, :200], **cache_kwargs(model, cache), use_cache=True)
        steps = [out.logits[:, -1].float()]
        for t in range(200, ids.shape[1]):
            step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **cache_kwargs(model, cache),
                         use_cache=True)
            steps.append(step.logits[:, -1].float())
        return torch.stack(steps, 1)

    with_compiled = logits()
    assert compiled.module().size() > 0, "the decode calls should have registered with the compiled launcher"
    monkeypatch.setattr(compiled, "ENABLED", False)
    with_python = logits()
    assert not with_compiled.isnan().any()
    assert torch.equal(with_compiled, with_python)
