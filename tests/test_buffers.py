"""TokenBuffer: its views are the live tokens after any sequence of appends, growths, drops, moves of the live range,
reorders and rebatches (against the same tokens kept by plain concatenation); they are the same objects until the
buffer changes; tensors it replaces are freed."""

from __future__ import annotations

import gc
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashquant_hf.buffers import TokenBuffer

OPS = st.lists(
    st.tuples(st.sampled_from(("append", "drop_front", "drop_back", "reorder", "rebatch")), st.integers(0, 40)),
    min_size=1, max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(ops=OPS, block=st.sampled_from((1, 16, 32)), max_capacity=st.sampled_from((None, 48, 80)),
       seed=st.integers(0, 2**31 - 1))
def test_views_are_the_live_tokens_after_any_changes(ops, block, max_capacity, seed):
    gen = torch.Generator().manual_seed(seed)
    buffer = TokenBuffer(block=block, max_capacity=max_capacity)
    expected = [torch.empty(2, 3, 0, 4), torch.empty(2, 3, 0)]
    for op, count in ops:
        if op == "append":
            parts = [torch.randn(2, 3, count, 4, generator=gen), torch.randn(2, 3, count, generator=gen)]
            buffer.append(*parts)
            expected = [torch.cat((e, p), dim=2) for e, p in zip(expected, parts)]
        elif op == "drop_front":
            count = min(count, buffer.length)
            buffer.drop_front(count)
            expected = [e[:, :, count:] for e in expected]
        elif op == "drop_back":
            count = min(count, buffer.length)
            buffer.drop_back(count)
            expected = [e[:, :, : e.shape[2] - count] for e in expected]
        elif op == "reorder":
            index = torch.randperm(2, generator=gen)
            buffer.reorder(index)
            expected = [e[index] for e in expected]
        else:
            buffer.rebatch(lambda t: t.flip(0))
            expected = [e.flip(0) for e in expected]
        views = buffer.views()
        assert views is buffer.views()
        assert len(views) == (2 if buffer.tensors else 0)
        for got, want in zip(views, expected):
            assert torch.equal(got, want)


def test_replaced_tensors_are_freed():
    buffer = TokenBuffer(block=4)
    buffer.append(torch.randn(1, 2, 4, 8))
    buffer.views()
    old = weakref.ref(buffer.tensors[0])
    buffer.append(torch.randn(1, 2, 1, 8))  # a growth: new tensors, the live tokens copied over
    gc.collect()
    assert old() is None
    assert buffer.views()[0].shape == (1, 2, 5, 8)
