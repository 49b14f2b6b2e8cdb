"""The CUDA decode's launch planning on CPU (``kernels/decode_launch.py``: builds, ``plan_decode``,
``balance_places``)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashquant_hf.kernels.decode_launch as dl
from flashquant_hf import store_layout


def finish_time(units, lengths, sms, first_speedup):
    """When the last CTA ends if CTAs take places in linear (split-major) order, SM by SM, the first place running
    ``first_speedup`` times faster than the second (the model balance_places plans for)."""
    ctas = [length for length in lengths for _ in range(units)]  # split-major: every unit's split 0 first
    return max(keys / (first_speedup if i < sms else 1.0) for i, keys in enumerate(ctas))


def split_lengths(plan):
    split_len, long_splits, short_len = plan.kernel_lengths
    return [split_len] * long_splits + [short_len] * (plan.splits - long_splits)


@settings(max_examples=200, deadline=None, derandomize=True)  # the same examples on every run
@given(units=st.integers(1, 300), length=st.integers(1, 300_000), sms=st.sampled_from([66, 108, 132]),
       log2_bs=st.sampled_from([None, 3, 4, 6]), speedup=st.sampled_from([1.05, 1.09, 1.2]))
def test_balanced_plan_covers_the_keys_and_shortens_the_slowest_place(units, length, sms, log2_bs, speedup):
    length = -(-length // dl.GRANULE) * dl.GRANULE
    plan = dl.plan_decode(units, length, 128, 2 * sms, log2_bs)
    balanced = dl.balance_places(plan, units, length, sms, 2, log2_bs, speedup)
    lengths = split_lengths(balanced)
    assert sum(lengths) >= length, (plan, balanced)
    if balanced == plan:
        return
    assert all(n % dl.GRANULE == 0 and n > 0 for n in lengths)
    ctas = units * plan.splits
    assert sms < ctas <= 2 * sms and balanced.splits == plan.splits
    assert units * balanced.long_splits <= sms  # every long split takes a first place
    assert balanced.split_len > balanced.short_len
    if log2_bs is not None:  # the block-table slice of a long split fits the kernel's shared copy
        assert balanced.shared_mem - dl.LUT_BYTES == 4 * ((balanced.split_len >> log2_bs) + 1) <= dl.MAX_PAGE_BYTES
    assert finish_time(units, lengths, sms, speedup) <= finish_time(units, split_lengths(plan), sms, speedup)


@pytest.mark.parametrize("units,length,splits,long_splits", [(64, 32768, 4, 2), (8, 131072, 32, 16)])
def test_h200_benchmark_shapes_get_longer_first_splits(units, length, splits, long_splits):
    plan = dl.balance_places(dl.plan_decode(units, length, 128, 264, 4), units, length, 132, 2, 4, 1.09)
    assert (plan.splits, plan.long_splits) == (splits, long_splits)
    ratio = plan.split_len / plan.short_len
    assert math.isclose(ratio, 1.09, rel_tol=0.03), ratio


@pytest.mark.parametrize("units,length,ctas_per_sm,speedup", [
    (256, 8192, 2, 1.09),   # one split per unit (B=32): nothing to move between places
    (64, 32768, 3, 1.09),   # 3 CTAs per SM: not the two-place model
    (64, 32768, 2, 1.0),    # switched off
    (4, 4096, 2, 1.09),     # fewer CTAs than SMs: every CTA has a first place
])
def test_balance_leaves_other_plans_alone(units, length, ctas_per_sm, speedup):
    plan = dl.plan_decode(units, length, 128, ctas_per_sm * 132, None)
    assert dl.balance_places(plan, units, length, 132, ctas_per_sm, None, speedup) == plan
    assert plan.kernel_lengths == (plan.split_len, plan.splits, plan.split_len)


@pytest.mark.parametrize("group,heads,units", [(1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 8, 1), (8, 8, 1), (12, 8, 2)])
def test_gqa_groups_pick_their_head_slots(group, heads, units):
    """GQA <= 4 runs the paired build (4 head slots per CTA), larger groups the 8-slot one in ceil(G / 8) CTAs."""
    assert dl.head_slots(group) == heads
    assert dl.units_shape(3, 2, group) == (3, 2, units)


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("log2_bs", [None, 3, 4, 6])
@pytest.mark.parametrize("heads", [4, 8])
def test_build_options_per_block_size_and_staged_tiles(capability, log2_bs, heads, monkeypatch):
    """Paged builds carry their block size; staged tiles (and their key order and shared memory) only for blocks of
    16 keys on sm_90 with 8-warp CTAs; contiguous builds neither."""
    mode = dl.MODE_CONTIGUOUS if log2_bs is None else dl.MODE_PAGED
    options = dl.build_options(mode, heads, log2_bs, 128, capability[0])
    assert (dl.PAIRED_OPTION in options) == (heads == 4)
    assert (f"-DFQD_PAGED_LOG2_BS={log2_bs}" in options) == (log2_bs is not None)
    staged = log2_bs == 4 and capability[0] == 9  # sm_90 only (later parts may not give a CTA 105 KB)
    assert (dl.TMA_OPTION in options) == staged
    assert len(options) == (heads == 4) + (log2_bs is not None) + staged
    assert dl.staged_tile_bytes(options, 128, 8) == (8 * 2 * (16 * 136 + 8) if staged else 0)
    assert dl.staged_tile_bytes(options, 128, 4) == 0
    assert dl.TMA_OPTION not in dl.build_options(mode, heads, log2_bs, 256, capability[0])  # 256: 4-warp CTAs
    monkeypatch.setattr(dl, "TMA_TILES", False)
    assert dl.TMA_OPTION not in dl.build_options(mode, heads, log2_bs, 128, capability[0])


def test_builds_hold_every_launch_build():
    """BUILDS (what tests/test_cuda_compile.py compiles) hold the build of every launch on sm_80 and sm_90: both
    head-slot counts, every block size, contiguous runs staged or not; staged tiles only on sm_90 for blocks of 16
    and the contiguous layout without key_bias, at head_dim <= 128."""
    builds = {options: set(names) for options, names in dl.BUILDS}
    for capability in (8, 9):
        for heads in (4, 8):
            for mode, sizes in ((dl.MODE_CONTIGUOUS, [None]), (dl.MODE_CONTIGUOUS_BIAS, [None]),
                                (dl.MODE_PAGED, [3, 4, 5, 6])):
                for log2_bs in sizes:
                    for head_dim in dl.HEAD_DIMS:
                        for runs_staged in (0, dl.RUNS_SEPARATE, dl.RUNS_INLINE):
                            options = dl.build_options(mode, heads, log2_bs, head_dim, capability, runs_staged)
                            assert {dl.kernel_name(head_dim, kind, mode) for kind in (0, 1, 2)} <= builds[options]
                            stageable = log2_bs == 4 if mode == dl.MODE_PAGED else (
                                mode == dl.MODE_CONTIGUOUS and runs_staged > 0)
                            assert (dl.TMA_OPTION in options) == (capability == 9 and head_dim <= 128 and stageable)
    staged = {options: names for options, names in builds.items() if dl.TMA_OPTION in options}
    assert len(staged) == 6 and all("<256," not in " ".join(names) for names in staged.values())
    assert all(len([n for n in names if n.endswith(", 4, 4>")]) == 6 for names in staged.values())


def test_builds_cover_every_code_width():
    """Every (key, value) width pair is compiled at head_dim 128 in the contiguous build and in the paired paged build
    with staged tiles, and the preset widths at every head_dim."""
    builds = {options: set(names) for options, names in dl.BUILDS}
    staged = builds[dl.build_options(dl.MODE_PAGED, 4, 4, 128, 9)]
    for k_bits in dl.BITS:
        for v_bits in dl.BITS:
            assert dl.kernel_name(128, 1, dl.MODE_CONTIGUOUS, k_bits, v_bits) in builds[()]
            assert dl.kernel_name(128, 1, dl.MODE_PAGED, k_bits, v_bits) in staged
    for head_dim in dl.HEAD_DIMS:
        for bits in ((3, 3), (3, 2), (2, 2), (1, 1)):
            assert dl.kernel_name(head_dim, 1, dl.MODE_CONTIGUOUS, *bits) in builds[()]


@pytest.mark.parametrize(("bits", "entries"), [(1, 16), (2, 256), (3, 256), (4, 256)])
def test_table_sizes_follow_the_code_width(bits, entries):
    """Entries at a 256-byte stride (128 bytes per table and entry, K and V interleaved) + the 1 KB slack."""
    assert dl.table_entries(bits) == entries
    assert dl.lut_bytes(bits, bits) == entries * 256 + 1024
    assert dl.lut_bytes(4, 4) == dl.LUT_BYTES


@pytest.mark.parametrize(("head_dim", "bits", "keys", "alignment"), [
    (128, 4, True, 16), (128, 4, False, 8), (64, 3, True, 2), (64, 3, False, 1), (128, 3, True, 4),
    (256, 3, False, 4), (64, 1, False, 1), (256, 2, True, 16),
])
def test_slice_alignment_is_the_lane_load_piece(head_dim, bits, keys, alignment):
    """A lane's slice (a quarter of a key row, an eighth of a value row) is read in the widest power-of-two pieces
    that divide it, at most 16 bytes."""
    assert store_layout.slice_alignment(head_dim, bits, keys) == alignment
    assert dl.token_bytes(head_dim, bits, bits) == head_dim * bits // 4 + 8


def test_tq_attention_routes_every_decode_width_to_a_kernel():
    """One query token: the decode kernel reads 1- to 4-bit codes at its head dims; chunks: the prefill kernel reads
    2- to 4-bit codes; everything else is named as the reason for the reference."""
    from flashquant_hf.kernels import tq_attention as ta

    for k_bits in dl.BITS:
        for v_bits in dl.BITS:
            assert ta.unsupported(k_bits, v_bits, 1, 128) is None
            chunk = ta.unsupported(k_bits, v_bits, 7, 128)
            assert (chunk is None) == (1 not in (k_bits, v_bits)), (k_bits, v_bits)
    assert "head_dim 96" in ta.unsupported(4, 4, 1, 96)
    assert "k_bits=1" in ta.unsupported(1, 2, 16, 64)


@pytest.mark.parametrize("head_dim, k_bits, v_bits, staged", [
    (128, 3, 3, True), (128, 4, 3, True), (128, 3, 4, True), (128, 3, 2, True), (64, 3, 2, True),
    (64, 2, 2, False), (128, 4, 4, False), (128, 2, 2, False), (128, 1, 1, False), (64, 4, 4, False),
])
def test_contiguous_staging_where_a_slice_takes_several_loads(head_dim, k_bits, v_bits, staged):
    """The contiguous layout stages its tiles exactly where a lane's key quarter or value eighth would take more than
    one register load in the widest pieces its alignment allows."""
    loads = [head_dim * bits // share // store_layout.slice_alignment(head_dim, bits, keys=share == 32)
             for bits, share in ((k_bits, 32), (v_bits, 64))]
    assert (max(loads) > 1) == staged
    assert store_layout.contiguous_staging_pays(head_dim, k_bits, v_bits) == staged


def test_prepared_call_reuse_needs_the_aligned_addresses():
    """A prepared call's reuse takes the addresses of the present tensors in order, and none at all when one lacks
    the byte alignment its build assumed."""
    import torch

    found = dl.PreparedCall(launch=None, alignment=(1, 16, 1, 4))
    buffer = torch.zeros(64, dtype=torch.uint8)
    aligned = buffer[(-buffer.data_ptr()) % 16 :]  # start 16-byte aligned
    query, norms = torch.zeros(3), torch.zeros(5)
    assert found.aligned_pointers((query, aligned, None, norms)) == (query.data_ptr(), aligned.data_ptr(),
                                                                     norms.data_ptr())
    assert found.aligned_pointers((query, aligned[4:], None, norms)) is None
    assert found.aligned_pointers((query, aligned, None, norms.view(torch.uint8)[1:])) is None
