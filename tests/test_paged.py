"""CPU tests of the paged TurboQuant store and of the reference paged decode (== contiguous reference)."""

import math

import pytest
import torch

from flashquant_hf.paged import BlockAllocator, PagedLayout, PagedTQCache
from flashquant_hf.quantizer import TurboQuantizer
from flashquant_hf.reference.decompress import dequantize_rotated
from flashquant_hf.reference.paged_decode import paged_decode
from flashquant_hf.reference.tq_attention import tq_attention


def test_layout_offsets_tq4_d128():
    lay = PagedLayout(block_size=16, num_kv_heads=8, head_dim=128)
    assert lay.bytes_per_token == 136  # D + 8: the seed's per-token record
    assert lay.head_block_bytes == 16 * 136
    assert lay.offsets == (0, 1024, 1088, 2112)
    assert all(o % 16 == 0 for o in lay.offsets)


def test_sections_byte_picture():
    """block_size 8, D 4, TQ4: per head  [K idx 8x2 | K norm 8x4 | V idx 8x2 | V norm 8x4] = 96 bytes.

    Writing K idx row 3 = (0x12, 0x34), K norm row 3 = 1.0, V idx row 0 = (0xAB, 0xCD), V norm row 7 = -2.0
    into head 1 of block 0 must land at bytes 6..7, 28..31, 48..49 and 92..95 of that head's section.
    """
    lay = PagedLayout(block_size=8, num_kv_heads=2, head_dim=4)
    blocks = torch.zeros(1, 2, lay.head_block_bytes, dtype=torch.uint8)
    k_idx, k_nrm, v_idx, v_nrm = lay.sections(blocks)
    k_idx[0, 1, 3] = torch.tensor([0x12, 0x34], dtype=torch.uint8)
    k_nrm[0, 1, 3] = 1.0
    v_idx[0, 1, 0] = torch.tensor([0xAB, 0xCD], dtype=torch.uint8)
    v_nrm[0, 1, 7] = -2.0
    head = blocks[0, 1]
    assert head[6:8].tolist() == [0x12, 0x34]
    assert head[28:32].view(torch.float32).item() == 1.0
    assert head[48:50].tolist() == [0xAB, 0xCD]
    assert head[92:96].view(torch.float32).item() == -2.0
    # 1.0f, -2.0f: 2 and 1 non-zero bytes
    assert int(blocks[0, 0].sum()) == 0 and int(head.count_nonzero()) == 2 + 2 + 2 + 1


@pytest.mark.parametrize("bad", [dict(block_size=12), dict(head_dim=7), dict(k_bits=5), dict(num_kv_heads=0)])
def test_layout_rejects(bad):
    args = dict(block_size=16, num_kv_heads=2, head_dim=64) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        PagedLayout(**args)


def test_allocator_all_or_nothing():
    alloc = BlockAllocator(4)
    assert alloc.allocate(3) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.free([1])
    assert sorted(alloc.allocate(2)) == [1, 3]
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([1, 1])
    assert alloc.num_free == 0


def test_reserve_slot_mapping_crosses_blocks():
    cache = PagedTQCache(num_blocks=6, block_size=8, num_kv_heads=1, head_dim=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    assert cache.reserve([a], [5]).tolist() == [0, 1, 2, 3, 4]  # block 0
    assert cache.reserve([b], [9]).tolist() == list(range(8, 16)) + [16]  # blocks 1, 2
    assert cache.reserve([a, b], [4, 1]).tolist() == [5, 6, 7, 24, 17]  # a spills into block 3
    assert cache.block_table([a, b]).tolist() == [[0, 3], [1, 2]]
    assert cache.seq_lens([a, b]).tolist() == [9, 10]
    assert cache.block_table([a]).dtype == torch.int32


def test_failed_calls_change_nothing(gen):
    cache = PagedTQCache(num_blocks=2, block_size=8, num_kv_heads=1, head_dim=64)
    seq = cache.add_sequence()
    before = (cache.allocator.num_free, cache.seq_len(seq), cache.blocks.clone())
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        cache.reserve([seq], [17])
    with pytest.raises(ValueError, match="`k` must be"):
        cache.append([seq], torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen))
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.reserve([seq + 1], [1])
    assert (cache.allocator.num_free, cache.seq_len(seq)) == before[:2]
    assert torch.equal(cache.blocks, before[2])


def test_free_sequence_returns_blocks(gen):
    cache = PagedTQCache(num_blocks=4, block_size=16, num_kv_heads=1, head_dim=64)
    seq = cache.add_sequence()
    cache.append([seq], torch.randn(40, 1, 64, generator=gen), torch.randn(40, 1, 64, generator=gen))
    assert cache.allocator.num_free == 1
    cache.free_sequence(seq)
    assert cache.allocator.num_free == 4
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.seq_len(seq)


def _contiguous_copy(cache: PagedTQCache, seq: int, layer: int = 0):
    """The stored bytes of ``seq`` gathered token by token through slot arithmetic (independent of the kernel
    path's gather): k_idx [1, H, N, kb], k_nrm [1, H, N], v_idx, v_nrm."""
    lay = cache.layout
    k_idx, k_nrm, v_idx, v_nrm = lay.sections(cache.blocks[layer])
    table = cache.block_table([seq])[0].tolist()
    rows = [(table[n // lay.block_size], n % lay.block_size) for n in range(cache.seq_len(seq))]

    def pick(section):
        if not rows:
            return section[:0, :, 0].transpose(0, 1).unsqueeze(0)
        return torch.stack([section[blk, :, r] for blk, r in rows], dim=1).unsqueeze(0)

    return pick(k_idx), pick(k_nrm), pick(v_idx), pick(v_nrm)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_append_stores_compressed_tokens(block_size, gen):
    cache = PagedTQCache(num_blocks=16, block_size=block_size, num_kv_heads=2, head_dim=64)
    seqs = [cache.add_sequence() for _ in range(3)]
    keys = {s: [] for s in seqs}
    values = {s: [] for s in seqs}
    for lens in ([37, 1, 0], [1, 1, 1], [0, 70, 5]):  # prefill chunks, decode steps, ragged appends
        k = torch.randn(sum(lens), 2, 64, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(sum(lens), 2, 64, dtype=torch.bfloat16, generator=gen)
        cache.append(seqs, k, v, num_tokens=lens)
        for s, a, n in zip(seqs, [0, lens[0], lens[0] + lens[1]], lens):
            keys[s].append(k[a : a + n])
            values[s].append(v[a : a + n])
    for s in seqs:
        k = torch.cat(keys[s]).transpose(0, 1).unsqueeze(0)
        v = torch.cat(values[s]).transpose(0, 1).unsqueeze(0)
        want_k = cache.k_quantizer.compress_tensors(k)
        want_v = cache.v_quantizer.compress_tensors(v)
        got = _contiguous_copy(cache, s)
        assert torch.equal(got[0], want_k[0]) and torch.equal(got[2], want_v[0])
        assert torch.equal(got[1], want_k[1]) and torch.equal(got[3], want_v[1])


def _random_cache(block_size, kv_heads, head_dim, lens, bits=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kq = TurboQuantizer(head_dim, bits, seed=3)
    vq = TurboQuantizer(head_dim, bits, seed=4)
    total_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = PagedTQCache(total_blocks, block_size, kv_heads, head_dim, k_quantizer=kq, v_quantizer=vq)
    seqs = [cache.add_sequence() for _ in lens]
    # A throw-away sequence first, freed again, so block ids are not simply 0, 1, 2, ...
    junk = cache.add_sequence()
    junk_kv = torch.randn(2, 2 * block_size + 1, kv_heads, head_dim, generator=gen)
    cache.append([junk], junk_kv[0], junk_kv[1])
    for s, n in zip(seqs, lens):
        k, v = torch.randn(2, n, kv_heads, head_dim, generator=gen)
        cache.append([s], k * 3, v)
    cache.free_sequence(junk)
    return cache, seqs


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_paged_equals_contiguous(block_size, group, head_dim, gen):
    lens = [1, 0, 97, 2 * block_size, 300]
    kv_heads = 2
    cache, seqs = _random_cache(block_size, kv_heads, head_dim, lens, seed=block_size + group + head_dim)
    lay = cache.layout
    q_rot = torch.randn(len(seqs), kv_heads * group, head_dim, generator=gen)
    kc, vc = cache.k_quantizer.centroids(), cache.v_quantizer.centroids()
    scale = head_dim**-0.5
    out, lse = paged_decode(
        q_rot, cache.blocks[0], cache.block_table(seqs), cache.seq_lens(seqs), kc, vc, 4, 4, scale, block_size
    )
    assert out.shape == (len(seqs), kv_heads * group, head_dim) and lse.shape == (len(seqs), kv_heads * group)
    for i, s in enumerate(seqs):
        k_idx, k_nrm, v_idx, v_nrm = _contiguous_copy(cache, s)
        want_o, want_l = tq_attention(q_rot[i : i + 1, :, None], k_idx, k_nrm, v_idx, v_nrm, kc, vc, 4, 4, scale)
        torch.testing.assert_close(out[i], want_o[0, :, 0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[i], want_l[0, :, 0], rtol=1e-5, atol=1e-6)
        if lens[i] == 0:
            assert torch.all(lse[i] == -math.inf) and torch.all(out[i] == 0)
            continue
        # Independent float64 softmax over the dequantized keys/values.
        keys = dequantize_rotated(k_idx, k_nrm, kc, 4, head_dim)[0].double().repeat_interleave(group, 0)
        values = dequantize_rotated(v_idx, v_nrm, vc, 4, head_dim)[0].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q_rot[i].double(), keys) * scale
        torch.testing.assert_close(lse[i].double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
        probs = torch.softmax(scores, -1)
        torch.testing.assert_close(out[i].double(), torch.einsum("hn,hnd->hd", probs, values), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3])
def test_reference_paged_other_bit_widths(bits, gen):
    cache, seqs = _random_cache(16, 1, 64, [5, 33], bits=bits)
    q_rot = torch.randn(2, 2, 64, generator=gen)
    kc, vc = cache.k_quantizer.centroids(), cache.v_quantizer.centroids()
    out, lse = paged_decode(q_rot, cache.blocks[0], cache.block_table(seqs), cache.seq_lens(seqs), kc, vc,
                            bits, bits, 0.125, 16)
    for i, s in enumerate(seqs):
        k_idx, k_nrm, v_idx, v_nrm = _contiguous_copy(cache, s)
        want_o, want_l = tq_attention(q_rot[i : i + 1, :, None], k_idx, k_nrm, v_idx, v_nrm, kc, vc, bits, bits, 0.125)
        torch.testing.assert_close(out[i], want_o[0, :, 0])
        torch.testing.assert_close(lse[i], want_l[0, :, 0])


def test_cache_decode_matches_exact_attention_on_dequantized_cache(gen):
    """PagedTQCache.decode (rotate q, paged decode, rotate back) == float64 attention over decompressed K/V."""
    cache, seqs = _random_cache(16, 2, 64, [50, 7])
    q = torch.randn(2, 4, 64, generator=gen)
    out, lse = cache.decode(q, seqs)
    for i, s in enumerate(seqs):
        k_idx, k_nrm, v_idx, v_nrm = _contiguous_copy(cache, s)
        dev = "cpu"
        k_hat = (dequantize_rotated(k_idx, k_nrm, cache.k_quantizer.centroids(), 4, 64)[0].double()
                 @ cache.k_quantizer.rotation(dev).double())
        v_hat = (dequantize_rotated(v_idx, v_nrm, cache.v_quantizer.centroids(), 4, 64)[0].double()
                 @ cache.v_quantizer.rotation(dev).double())
        scores = torch.einsum("hd,hnd->hn", q[i].double(), k_hat.repeat_interleave(2, 0)) / 8.0
        want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v_hat.repeat_interleave(2, 0))
        torch.testing.assert_close(out[i].double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[i].double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
