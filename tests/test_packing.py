import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashquant_hf.packing import pack_indices, packed_size, unpack_indices


def test_tq4_byte_order_is_high_nibble_first():
    idx = torch.tensor([[1, 2, 15, 0]])
    assert pack_indices(idx, 4).tolist() == [[0x12, 0xF0]]


def test_tq2_and_tq3_are_msb_first_bit_streams():
    assert pack_indices(torch.tensor([[3, 0, 1, 2]]), 2).tolist() == [[0b11000110]]
    idx = torch.tensor([[7, 0, 1, 2, 3, 4, 5, 6]])
    stream = "".join(format(v, "03b") for v in idx[0].tolist())
    expected = [int(stream[i : i + 8], 2) for i in range(0, 24, 8)]
    assert pack_indices(idx, 3).tolist() == [expected]


@settings(max_examples=60, deadline=None, derandomize=True)  # the same examples on every run
@given(
    bits=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([2, 6, 10, 64, 128, 256]),
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact(bits, head_dim, lead, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 2**bits, (*lead, head_dim), generator=g)
    packed = pack_indices(idx, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, packed_size(head_dim, bits))
    assert torch.equal(unpack_indices(packed, bits, head_dim), idx)


def test_unpack_rejects_wrong_width():
    with pytest.raises(ValueError, match="last dimension 64"):
        unpack_indices(torch.zeros(3, 32, dtype=torch.uint8), 4, 128)
    with pytest.raises(ValueError, match="uint8"):
        unpack_indices(torch.zeros(3, 64, dtype=torch.int32), 4, 128)
