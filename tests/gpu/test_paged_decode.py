"""GPU tests of the paged split-K decode (``kernels/paged_decode.py``) against the reference paged decode in
float64: errors within 2x those of PyTorch computing the same attention in the kernel's dtype (tests/tolerance.py),
per sequence."""

import functools
import math

import pytest
import torch
from tolerance import assert_attention_within_dtype_error

from flashquant_hf.paged import PagedLayout, PagedTQCache
from flashquant_hf.reference.paged_decode import paged_decode as reference_paged_decode

from .decode_helpers import DEV, WIDTHS, centroids, compute_dtype, decode_in_dtype
from .poison import poisoned_allocations


def random_store(lens, block_size, kv_heads, head_dim, seed=0, k_bits=4, v_bits=4):
    """Random blocks of k_bits / v_bits codes, shuffled block ids per sequence, int32 block table and lengths."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    layout = PagedLayout(block_size, kv_heads, head_dim, k_bits, v_bits)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    blocks = torch.randint(0, 256, (num_blocks, kv_heads, layout.head_block_bytes), dtype=torch.uint8,
                           device=DEV, generator=g)
    _, k_nrm, _, v_nrm = layout.sections(blocks)
    k_nrm.copy_(torch.rand(k_nrm.shape, device=DEV, generator=g) * 8 + 0.5)  # finite norms everywhere
    v_nrm.copy_(torch.rand(v_nrm.shape, device=DEV, generator=g) * 4 + 0.5)
    perm = torch.randperm(num_blocks, device=DEV, generator=g).tolist()
    width = max(1, max(need))
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n
    return blocks, table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def decode_poisoned(*args):
    """``paged_decode(*args)`` from cleared caches with every ``torch.empty`` poisoned; returns its result and the
    one launch it planned."""
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.paged_decode import paged_decode

    dl.clear_caches()
    with poisoned_allocations():
        result = paged_decode(*args)
    (setup,) = dl._LAUNCHES.values()
    return result, setup


def paged_in_dtype(q_rot, blocks, block_table, seq_lens, k_centroids, v_centroids, k_bits, v_bits, scale,
                   block_size):
    """The paged decode's arguments -> (out [S, Hq, D], lse [S, Hq]) of PyTorch attention over each sequence's
    dequantized blocks in the kernel's dtype."""
    layout = PagedLayout(block_size, blocks.shape[1], q_rot.shape[-1], k_bits, v_bits)
    sections = layout.sections(blocks)
    outs, lses = [], []
    for s, length in enumerate(seq_lens.tolist()):
        ids = block_table[s, : -(-length // block_size)].long()
        k_idx, k_nrm, v_idx, v_nrm = (x[ids].transpose(0, 1).flatten(1, 2)[None, :, :length] for x in sections)
        out, lse = decode_in_dtype(q_rot[s : s + 1, :, None], k_idx, k_nrm, v_idx, v_nrm, k_centroids, v_centroids,
                                   k_bits, v_bits, scale)
        outs.append(out[0, :, 0])
        lses.append(lse[0, :, 0])
    return torch.stack(outs), torch.stack(lses)


def check(q_rot, blocks, table, lens, block_size, max_seq_len=None, bits=(4, 4), result=None, scale=None):
    """paged_decode's (out, lse) (``result``, or a fresh call) against the float64 reference, within 2x PyTorch's
    error in the kernel's dtype, sequence by sequence so a wrong short sequence is not hidden by a long one's
    scale."""
    from flashquant_hf.kernels.paged_decode import paged_decode

    ck, cv = centroids(q_rot.shape[-1], bits[0]), centroids(q_rot.shape[-1], bits[1])
    scale = q_rot.shape[-1] ** -0.5 if scale is None else scale
    args = (blocks, table, lens, ck, cv, *bits, scale, block_size)
    out, lse = paged_decode(q_rot, *args, max_seq_len) if result is None else result
    assert out.shape == q_rot.shape and lse.shape == q_rot.shape[:2]
    exact, in_dtype = reference_paged_decode(q_rot.double(), *args), paged_in_dtype(q_rot, *args)
    for s in range(q_rot.shape[0]):
        assert_attention_within_dtype_error((out[s], lse[s]), [t[s] for t in exact], [t[s] for t in in_dtype],
                                            compute_dtype(q_rot.dtype), f"sequence {s} (length {int(lens[s])})")
    return out, lse


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_ragged(block_size, group, head_dim, cuda_gen):
    lens = [1, 0, 37, 300, 2 * block_size, 4099]
    kv_heads = 2
    blocks, table, lens_t = random_store(lens, block_size, kv_heads, head_dim, seed=block_size * group + head_dim)
    q = torch.randn(len(lens), kv_heads * group, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check(q, blocks, table, lens_t, block_size)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_paged_decode_prefetch_distances(prefetch, monkeypatch, cuda_gen):
    import flashquant_hf.kernels.decode_launch as dl

    monkeypatch.setattr(dl, "PREFETCH_CHUNKS", prefetch)
    lens = [5000, 17, 1, 0, 2222]
    blocks, table, lens_t = random_store(lens, 8, 2, 128, seed=20 + prefetch)
    q = torch.randn(len(lens), 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check(q, blocks, table, lens_t, 8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_paged_decode_dtypes_long(dtype, cuda_gen):
    lens = [32768, 1, 9000, 16]
    blocks, table, lens_t = random_store(lens, 16, 8, 128, seed=3)
    q = (torch.randn(len(lens), 32, 128, device=DEV, generator=cuda_gen) * 2).to(dtype)
    check(q, blocks, table, lens_t, 16)


def test_paged_decode_head_dim_256(cuda_gen):
    lens = [5, 700]
    blocks, table, lens_t = random_store(lens, 32, 1, 256, seed=4)
    q = torch.randn(2, 4, 256, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check(q, blocks, table, lens_t, 32)


def test_paged_decode_all_empty_and_poisoned_outputs(cuda_gen):
    from flashquant_hf.kernels.paged_decode import paged_decode

    blocks, table, lens_t = random_store([0, 0], 16, 2, 128)
    q = torch.randn(2, 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    with poisoned_allocations():
        out, lse = paged_decode(q, blocks, table, lens_t, c, c, 4, 4, 0.1, 16)
    assert torch.all(lse == -math.inf) and torch.all(out == 0)


def test_paged_decode_poisoned_multi_split(cuda_gen):
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.paged_decode import paged_decode

    lens = [20000, 3, 0]
    blocks, table, lens_t = random_store(lens, 16, 2, 128, seed=6)
    q = torch.randn(3, 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    dl.clear_caches()
    c = centroids(128)
    with poisoned_allocations():
        out, lse = paged_decode(q, blocks, table, lens_t, c, c, 4, 4, 128**-0.5, 16, max_seq_len=20000)
    check(q, blocks, table, lens_t, 16, result=(out, lse))


def test_cache_decode_cuda_matches_reference_on_same_bytes(monkeypatch, cuda_gen):
    """PagedTQCache on the GPU (store + CUDA decode) == reference decode of the stored bytes. Compression goes
    through the reference here so this test depends on the decode kernel only."""
    from flashquant_hf import ops

    monkeypatch.setattr(ops, "compress", functools.partial(ops.compress, backend="torch"))
    cache = PagedTQCache(num_blocks=64, block_size=16, num_kv_heads=2, head_dim=128, device=DEV)
    seqs = [cache.add_sequence() for _ in range(3)]
    k, v = torch.randn(2, 300, 2, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    cache.append(seqs, k, v, num_tokens=[100, 1, 199])
    q = torch.randn(3, 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    out, lse = cache.decode(q, seqs)
    q_rot = q.double() @ cache.k_quantizer.rotation(DEV).double().T
    args = (cache.blocks[0], cache.block_table(seqs), cache.seq_lens(seqs), cache.k_quantizer.centroids(DEV),
            cache.v_quantizer.centroids(DEV), 4, 4, 128**-0.5, 16)
    exact_out, exact_lse = reference_paged_decode(q_rot, *args)
    torch_out, torch_lse = paged_in_dtype(q_rot.to(q.dtype), *args)
    rotate_back = cache.v_quantizer.rotation(DEV).double()
    assert_attention_within_dtype_error((out, lse), (exact_out.double() @ rotate_back, exact_lse),
                                        (torch_out.double() @ rotate_back, torch_lse), compute_dtype(q.dtype))


def test_paged_decode_rejects_bad_widths_and_tables(cuda_gen):
    from flashquant_hf.kernels.paged_decode import paged_decode

    blocks, table, lens_t = random_store([10], 16, 2, 128)
    q = torch.randn(1, 4, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    with pytest.raises(ValueError, match=r"`v_bits` must be one of \(1, 2, 3, 4\)"):
        paged_decode(q, blocks, table, lens_t, c, c, 4, 0, 0.1, 16)
    with pytest.raises(ValueError, match="`blocks` must be uint8 of shape"):  # TQ4 blocks read as 4/3-bit codes
        paged_decode(q, blocks, table, lens_t, c, centroids(128, 3), 4, 3, 0.1, 16)
    with pytest.raises(ValueError, match="`block_table` must be int32"):
        paged_decode(q, blocks, table.long(), lens_t, c, c, 4, 4, 0.1, 16)
    with pytest.raises(ValueError, match="`blocks` must be uint8"):
        paged_decode(q, blocks, table, lens_t, c, c, 4, 4, 0.1, 32)


@pytest.mark.parametrize("warps", [4, 8])
def test_paged_decode_warp_variants(warps, monkeypatch, cuda_gen):
    """Both CTA shapes (template W) on ragged sequences, small blocks (more page lookups) and GQA 8."""
    import flashquant_hf.kernels.decode_launch as dl

    monkeypatch.setattr(dl, "WARPS", warps)
    dl.clear_caches()
    lens = [7000, 1, 0, 129, 2048]
    blocks, table, lens_t = random_store(lens, 8, 2, 128, seed=50 + warps)
    q = torch.randn(len(lens), 16, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check(q, blocks, table, lens_t, 8)
    blocks, table, lens_t = random_store(lens, 32, 2, 64, seed=60 + warps)
    check(torch.randn(len(lens), 4, 64, device=DEV, dtype=torch.float16, generator=cuda_gen), blocks, table, lens_t, 32)
    dl.clear_caches()


def test_paged_decode_fast_launch_matches_cupy_launch(monkeypatch, cuda_gen):
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.paged_decode import paged_decode

    c = centroids(128)
    for seed, lens in enumerate(([3000, 5], [40, 9000, 1])):
        blocks, table, lens_t = random_store(lens, 16, 2, 128, seed=70 + seed)
        q = torch.randn(len(lens), 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
        monkeypatch.setattr(dl, "FAST_LAUNCH", True)
        fast = paged_decode(q, blocks, table, lens_t, c, c, 4, 4, 0.09, 16)
        monkeypatch.setattr(dl, "FAST_LAUNCH", False)
        slow = paged_decode(q, blocks, table, lens_t, c, c, 4, 4, 0.09, 16)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
        check(q, blocks, table, lens_t, 16, result=fast, scale=0.09)


def test_paged_decode_balanced_places(monkeypatch, cuda_gen):
    """66 units x 4 splits fill the H200's 264 places: the plan gives the 132 first places (the CTAs numbered first)
    longer splits than the second ones (``balance_places``); ragged lengths leave some short splits partial or
    empty. Outputs poisoned first; both plans match the reference."""
    import flashquant_hf.kernels.decode_launch as dl

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seqs = sms // 4  # x 2 KV heads = sms / 2 units
    lens = [16384 - 61 * (i % 7) for i in range(seqs - 1)] + [300]  # 4 splits of ~4K: room for 1.09x
    blocks, table, lens_t = random_store(lens, 16, 2, 128, seed=90)
    q = torch.randn(len(lens), 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(128)
    results = {}
    for speedup in (1.09, 1.0):
        monkeypatch.setattr(dl, "FIRST_PLACE_SPEEDUP", speedup)
        results[speedup], setup = decode_poisoned(q, blocks, table, lens_t, c, c, 4, 4, 0.09, 16, 16384)
        assert (setup.plan.long_splits is not None) == (speedup != 1.0), setup.plan
    for result in results.values():
        check(q, blocks, table, lens_t, 16, result=result, scale=0.09)
    dl.clear_caches()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_decode_rising_scores(dtype, block_size, cuda_gen):
    """Key norms that grow along each sequence (0.5 -> 24, and a few outliers of 40 late), so the running max keeps
    rising: in steps below the rescale slack (bf16 P V: P up to 2^8, no rescale) and in jumps above it (a rescale);
    fp16 queries rescale at every new max. Large value norms (up to 200) check the fp16 range of P * norm."""
    lens = [4000, 2500, 700]
    blocks, table, lens_t = random_store(lens, block_size, 2, 128, seed=7 + block_size)
    layout = PagedLayout(block_size, 2, 128)
    _, k_nrm, _, v_nrm = layout.sections(blocks)
    g = torch.Generator(device=DEV).manual_seed(11)
    for i, n in enumerate(lens):
        ramp = torch.linspace(0.5, 24.0, n, device=DEV)
        late = torch.randint(n // 2, n, (4,), device=DEV, generator=g)
        ramp[late] = 40.0
        for j in range(-(-n // block_size)):
            rows = ramp[j * block_size : (j + 1) * block_size]
            k_nrm[table[i, j], :, : rows.numel()] = rows
        v_nrm[table[i, : -(-n // block_size)]] = 200.0 * torch.rand(v_nrm[table[i, : -(-n // block_size)]].shape,
                                                                     device=DEV, generator=g)
    q = torch.randn(len(lens), 8, 128, device=DEV, dtype=dtype, generator=cuda_gen)
    check(q, blocks, table, lens_t, block_size)


@pytest.mark.parametrize("group", [3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_staged_and_register_tiles(group, head_dim, monkeypatch, cuda_gen):
    """Blocks of 16 keys: the tiles bulk-copied into shared memory (sm_90) and the register loads (other GPUs,
    TMA_TILES False) both equal the reference on ragged sequences (a split's partial last tile, empty and
    one-key sequences), with the paired build (GQA 3: three of its four head slots) and the 8-slot one; outputs
    poisoned first."""
    import flashquant_hf.kernels.decode_launch as dl

    lens = [4100, 0, 1, 17, 999]
    blocks, table, lens_t = random_store(lens, 16, 2, head_dim, seed=130 + group + head_dim)
    q = torch.randn(len(lens), 2 * group, head_dim, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    c = centroids(head_dim)
    staged_available = torch.cuda.get_device_capability()[0] == 9
    for staged in (True, False):
        monkeypatch.setattr(dl, "TMA_TILES", staged)
        result, setup = decode_poisoned(q, blocks, table, lens_t, c, c, 4, 4, head_dim**-0.5, 16)
        assert (setup.prefetch == dl.TMA_PREFETCH_CHUNKS and setup.plan.shared_mem > dl.LUT_BYTES + dl.MAX_PAGE_BYTES) \
            == (staged and staged_available), setup
        check(q, blocks, table, lens_t, 16, result=result)
    dl.clear_caches()


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [4, 8])
def test_paged_decode_every_width(bits, block_size, group, cuda_gen):
    """Every (key, value) code width at head_dim 128 on ragged sequences: blocks of 16 take the staged tiles on sm_90
    (paired build at GQA 4), blocks of 8 the register loads."""
    lens = [1, 0, 37, 2 * block_size + 3, 2222]
    blocks, table, lens_t = random_store(lens, block_size, 2, 128, seed=200 + 4 * bits[0] + bits[1], k_bits=bits[0],
                                         v_bits=bits[1])
    q = torch.randn(len(lens), 2 * group, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
    check(q, blocks, table, lens_t, block_size, bits=bits)


@pytest.mark.parametrize("bits", [(3, 3), (3, 2), (2, 2), (1, 1)])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_paged_decode_widths_head_dims(bits, head_dim, cuda_gen):
    lens = [300, 1, 4099]
    blocks, table, lens_t = random_store(lens, 16, 2, head_dim, seed=300 + head_dim, k_bits=bits[0], v_bits=bits[1])
    q = torch.randn(len(lens), 2, head_dim, device=DEV, dtype=torch.float16, generator=cuda_gen)
    check(q, blocks, table, lens_t, 16, bits=bits)


@pytest.mark.parametrize("bits", [(4, 4), (3, 2)])
def test_paged_decode_prepared_call_follows_every_pointer(bits, cuda_gen):
    """With ``max_seq_len`` given, calls of one signature reuse the first call's prepared launch: a loop over
    different stores, tables, lengths and queries of the same shapes (several splits, then one) gives each call its
    own result, outputs poisoned before every launch."""
    import flashquant_hf.kernels.decode_launch as dl
    from flashquant_hf.kernels.paged_decode import paged_decode

    dl.clear_caches()
    ck, cv = centroids(128, bits[0]), centroids(128, bits[1])
    for lens_list in ([[3000, 700], [2999, 2001], [17, 3000]], [[40, 9], [33, 1]]):
        max_len = max(max(lens) for lens in lens_list)
        for seed, lens in enumerate(lens_list * 2):
            blocks, table, lens_t = random_store([max_len, max_len], 16, 2, 128, seed=90 + seed, k_bits=bits[0],
                                                 v_bits=bits[1])
            lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
            q = torch.randn(2, 8, 128, device=DEV, dtype=torch.bfloat16, generator=cuda_gen)
            with poisoned_allocations():
                result = paged_decode(q, blocks, table, lens_t, ck, cv, *bits, 128**-0.5, 16, max_len)
            check(q, blocks, table, lens_t, 16, bits=bits, result=result)
    assert dl._PREPARED, "the calls above should have gone through a prepared launch"
    dl.clear_caches()
