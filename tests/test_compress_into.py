"""``compress_into`` on the CPU reference path: the ``flashquant::compress_into`` custom op writes, into rows
``start .. start + n`` of a store, exactly what ``compress`` followed by ``index_copy_`` writes, leaves every other
row as it was, refuses bad arguments before writing anything, and compiles into a graph that writes the store itself.
The reference writes into strided views too (codes and norm side by side in rows of one uint8 buffer), and the kernel
wrapper's layout check (:func:`flashquant_hf.kernels.compress.store_pitches`) accepts those rows and refuses, naming
the tensor, the layouts its kernel cannot address.

The store drawn for a call with B = 2, H = 3, N = 9 slots, n = 4 rows, start = 5 (``.`` poison, ``#`` written)::

    packed[b, h] (and norms[b, h])   slot 0 1 2 3 4 5 6 7 8
                                          . . . . . # # # #
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from flashquant_hf import custom_ops  # noqa: F401  (registers torch.ops.flashquant)
from flashquant_hf import ops
from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.kernels.compress import store_pitches
from flashquant_hf.packing import packed_size
from flashquant_hf.reference.compress import compress as reference_compress
from flashquant_hf.reference.compress import compress_into as reference_compress_into
from flashquant_hf.rotation import hadamard_signs, random_rotation

POISON_BYTE, POISON_NORM = 0xAB, float("nan")


def _tables(head_dim: int, bits: int, kind: str):
    rotation = random_rotation(head_dim, 3, kind)
    signs = hadamard_signs(head_dim, 3) if kind == "hadamard" else None
    centroids, boundaries = lloyd_max_codebook(head_dim, bits).tensors("cpu")
    return rotation, boundaries, centroids, signs


def _store(lead: tuple[int, ...], slots: int, head_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.full(lead + (slots, packed_size(head_dim, bits)), POISON_BYTE, dtype=torch.uint8)
    return packed, torch.full(lead + (slots,), POISON_NORM)


def _call(x, tables, bits, packed, norms, start, norm_correction=False):
    rotation, boundaries, centroids, signs = tables
    torch.ops.flashquant.compress_into(x, rotation, boundaries, centroids, signs, bits, norm_correction, "torch",
                                       packed, norms, start)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("kind", ["hadamard", "haar"])
def test_writes_what_compress_then_index_copy_writes(head_dim, bits, kind, gen):
    tables = _tables(head_dim, bits, kind)
    rotation, boundaries, centroids, signs = tables
    for batch, heads, slots, n, layout in [(2, 3, 9, 4, "contiguous"), (1, 2, 40, 1, "contiguous"),
                                           (2, 2, 33, 7, "transposed"), (3, 1, 8, 8, "contiguous")]:
        for norm_correction in (False, True):
            x = torch.randn(batch, n, heads, head_dim, generator=gen).transpose(1, 2)
            x = x.contiguous() if layout == "contiguous" else x  # HF's [B, L, H, D] view, strided
            first = int(torch.randint(0, slots - n + 1, (), generator=gen))
            start = torch.tensor(first) if first % 2 else torch.tensor([first])  # 0-dim and [1]
            packed, norms = _store((batch, heads), slots, head_dim, bits)
            want_packed, want_norms = packed.clone(), norms.clone()
            codes, code_norms = reference_compress(x, rotation, boundaries, bits, centroids, norm_correction, signs)
            positions = torch.arange(first, first + n)
            want_packed.index_copy_(2, positions, codes)
            want_norms.index_copy_(2, positions, code_norms)
            _call(x, tables, bits, packed, norms, start, norm_correction)
            label = f"B={batch} H={heads} N={slots} n={n} start={first} {layout} nc={norm_correction}"
            assert torch.equal(packed, want_packed), label
            assert torch.equal(norms.nan_to_num(), want_norms.nan_to_num()), label
            outside = torch.ones(slots, dtype=torch.bool)
            outside[first : first + n] = False
            assert (packed[:, :, outside] == POISON_BYTE).all() and norms[:, :, outside].isnan().all(), label
            assert not norms[:, :, ~outside].isnan().any(), label


def test_ops_compress_into_is_the_op(gen):
    """``ops.compress_into`` (the op's body) on the torch backend: the same rows as the custom op."""
    head_dim, bits = 64, 4
    tables = _tables(head_dim, bits, "hadamard")
    rotation, boundaries, centroids, signs = tables
    x = torch.randn(2, 2, 5, head_dim, generator=gen)
    got, want = _store((2, 2), 12, head_dim, bits), _store((2, 2), 12, head_dim, bits)
    ops.compress_into(x, rotation, boundaries, bits, *got, torch.tensor(6), centroids, True, signs, backend="torch")
    _call(x, tables, bits, *want, torch.tensor(6), norm_correction=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].nan_to_num(), want[1].nan_to_num())


def _inline_rows(lead: tuple[int, ...], slots: int, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A uint8 store ``rows [..., N, row_bytes + 4]`` filled with 0xFF, and its views ``packed`` (the codes) and
    ``norms`` (the fp32 norm after them)."""
    rows = torch.full(lead + (slots, row_bytes + 4), 0xFF, dtype=torch.uint8)
    return rows, rows[..., :row_bytes], rows[..., row_bytes:].view(torch.float32).squeeze(-1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_reference_writes_into_inline_rows(head_dim, bits, gen):
    """Codes and norm side by side in one row: the rows ``start .. start + n`` hold exactly ``compress``'s codes and
    norms' bytes, every other byte keeps its 0xFF."""
    rotation, boundaries, centroids, signs = _tables(head_dim, bits, "hadamard")
    row_bytes = packed_size(head_dim, bits)
    for lead, slots, n in [((2, 3), 9, 4), ((), 12, 12), ((1, 2, 2), 30, 1)]:
        x = torch.randn(lead + (n, head_dim), generator=gen)
        first = int(torch.randint(0, slots - n + 1, (), generator=gen))
        rows, packed, norms = _inline_rows(lead, slots, row_bytes)
        reference_compress_into(x, rotation, boundaries, bits, packed, norms, torch.tensor(first), centroids, True,
                                signs)
        codes, code_norms = reference_compress(x, rotation, boundaries, bits, centroids, True, signs)
        want = torch.full_like(rows, 0xFF)
        want[..., first : first + n, :row_bytes] = codes
        want[..., first : first + n, row_bytes:] = code_norms.unsqueeze(-1).view(torch.uint8)
        assert torch.equal(rows, want), f"lead={lead} N={slots} n={n} start={first}"


def test_kernel_store_pitches_of_contiguous_and_inline_rows():
    """The row pitches the kernel writes with: the row length for contiguous stores, the inline row's for views."""
    row_bytes = packed_size(128, 3)
    assert store_pitches(torch.empty(2, 3, 9, row_bytes, dtype=torch.uint8), torch.empty(2, 3, 9)) == (row_bytes, 1)
    _, packed, norms = _inline_rows((2, 3), 9, row_bytes)
    assert store_pitches(packed, norms) == (row_bytes + 4, (row_bytes + 4) // 4)
    _, packed, norms = _inline_rows((1, 1), 1, row_bytes)  # a single row: its pitch is never used
    assert store_pitches(packed, norms) == (row_bytes, 1)


# (store overrides, message): layouts the kernel cannot write, refused naming the tensor and its strides.
BAD_LAYOUTS = [
    (lambda p, m: dict(packed=p.transpose(0, 1), norms=m.transpose(0, 1)),
     r"`packed` must have one uniform stride between consecutive rows .* strides \(612, 1836, 68, 1\)"),
    (lambda p, m: dict(norms=torch.zeros(2, 3, 10)[..., :9]),
     r"`norms` must have one uniform stride between consecutive rows .* strides \(30, 10, 1\)"),
    (lambda p, m: dict(packed=p[:, :, ::2], norms=m[:, :, ::2]),  # every other slot
     r"`packed` must have one uniform stride .* strides \(1836, 612, 136, 1\)"),
    (lambda p, m: dict(packed=torch.zeros(2, 3, 9, 66, dtype=torch.uint8)[..., :64]),
     r"`packed` rows must start at 4-byte aligned addresses \(row pitch 66 bytes.* strides \(1782, 594, 66, 1\)"),
    (lambda p, m: dict(packed=torch.zeros(2, 3, 9, 68, dtype=torch.uint8)[..., 2:66]),
     r"`packed` rows must start at 4-byte aligned addresses \(row pitch 68 bytes, address 2 mod 4\)"),
    (lambda p, m: dict(packed=torch.zeros(2, 3, 9, 128, dtype=torch.uint8)[..., ::2]),
     r"`packed` must have contiguous rows \(last stride 1\).* strides \(3456, 1152, 128, 2\)"),
    (lambda p, m: dict(packed=torch.zeros(1, 64, dtype=torch.uint8).expand(54, 64).view(2, 3, 9, 64)),
     r"`packed` rows must not overlap \(row pitch 0 < row length 64\)"),
]


@pytest.mark.parametrize("overrides,match", BAD_LAYOUTS)
def test_kernel_store_pitches_refuse_layouts_the_kernel_cannot_write(overrides, match):
    _, packed, norms = _inline_rows((2, 3), 9, 64)
    args = dict(packed=packed, norms=norms)
    args.update(overrides(packed, norms))
    with pytest.raises(ValueError, match=match):
        store_pitches(args["packed"], args["norms"])


# (argument overrides, error, message): each is refused before anything is written.
BAD_CALLS = [
    (lambda a: dict(packed=a["packed"].float()), ValueError, r"`packed` must be uint8 of shape \[2, 3, N, 32\]"),
    (lambda a: dict(packed=a["packed"][..., :31]), ValueError, r"`packed` must be uint8 .* 32 bytes per row"),
    (lambda a: dict(packed=a["packed"][:1]), ValueError, r"`packed` must be uint8 of shape"),
    (lambda a: dict(norms=a["norms"][..., :8]), ValueError, r"`norms` must be float32 of shape \[2, 3, 9\]"),
    (lambda a: dict(norms=a["norms"].double()), ValueError, r"`norms` must be float32"),
    (lambda a: dict(x=a["x"][..., :32]), ValueError, r"`packed` must be uint8 of shape \[2, 3, N, 16\]"),
    (lambda a: dict(x=a["x"][0]), ValueError, r"`packed` must be uint8 of shape \[3, N, 32\]"),
    (lambda a: dict(x=a["x"][0, 0, 0]), ValueError, r"`x` must have the shape \[..., n, head_dim\]"),
    (lambda a: dict(x=torch.zeros(2, 3, 10, 64)), ValueError, r"9 slots .* fewer than the 10 rows of `x`"),
    (lambda a: dict(start=torch.tensor(2.0)), ValueError, r"`start` must be an int64 tensor of one element"),
    (lambda a: dict(start=torch.tensor([1, 2])), ValueError, r"`start` must be an int64 tensor of one element"),
    (lambda a: dict(start=torch.tensor([[1]])), ValueError, r"`start` must be an int64 tensor of one element"),
    (lambda a: dict(start=torch.tensor(-1)), ValueError, r"`start` must be in \[0, 5\] .* got -1"),
    (lambda a: dict(start=torch.tensor(6)), ValueError, r"`start` must be in \[0, 5\] to write 4 rows into 9 slots"),
    (lambda a: dict(start=torch.tensor(1, device="meta")), ValueError, r"must share a device"),
]


@pytest.mark.parametrize("overrides,error,match", BAD_CALLS)
def test_bad_arguments_raise_and_write_nothing(overrides, error, match, gen):
    head_dim, bits = 64, 4
    tables = _tables(head_dim, bits, "hadamard")
    packed, norms = _store((2, 3), 9, head_dim, bits)
    args = dict(x=torch.randn(2, 3, 4, head_dim, generator=gen), packed=packed, norms=norms, start=torch.tensor(2))
    args.update(overrides(args))
    before = packed.clone(), norms.clone()
    with pytest.raises(error, match=match):
        _call(args["x"], tables, bits, args["packed"], args["norms"], args["start"])
    assert torch.equal(packed, before[0]) and norms.isnan().all()


def test_opcheck_schema_fake_and_mutation(gen):
    """torch.library's own checks: the declared mutations are the real ones, the fake runs under FakeTensor, and
    the op works through AOT dispatch (what torch.compile uses)."""
    head_dim, bits = 64, 3
    rotation, boundaries, centroids, signs = _tables(head_dim, bits, "hadamard")
    packed, norms = _store((2, 2), 10, head_dim, bits)
    x = torch.randn(2, 2, 3, head_dim, generator=gen)
    torch.library.opcheck(torch.ops.flashquant.compress_into.default,
                          (x, rotation, boundaries, centroids, signs, bits, False, "torch", packed,
                           norms.nan_to_num(), torch.tensor(4)))


class _Store(torch.nn.Module):
    """A store and its counter, written by a compiled step as a static TurboQuantCache layer writes them."""

    def __init__(self, tables, bits: int, head_dim: int):
        super().__init__()
        self.tables, self.bits = tables, bits
        self.packed, self.norms = _store((2, 2), 64, head_dim, bits)
        self.count = torch.zeros((), dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotation, boundaries, centroids, signs = self.tables
        start = self.count.clone()
        torch.ops.flashquant.compress_into(x * 2, rotation, boundaries, centroids, signs, self.bits, False, "torch",
                                           self.packed, self.norms, start)
        self.count.add_(x.shape[2])
        return x.sum()


@pytest.mark.slow
def test_compiled_step_writes_the_store_in_place(gen):
    """Inductor (fullgraph) calls the op on the store tensors themselves: no store-sized buffer is allocated or
    copied back, and three steps at the counter's advancing offsets write what eager steps write."""
    head_dim, bits = 64, 4
    tables = _tables(head_dim, bits, "hadamard")
    eager, compiled = _Store(tables, bits, head_dim), _Store(tables, bits, head_dim)
    step = torch.compile(compiled, fullgraph=True)
    blocks = [torch.randn(2, 2, 8, head_dim, generator=gen) for _ in range(3)]
    with torch.no_grad():
        _, code = run_and_get_code(step, blocks[0])
        for x in blocks[1:]:
            step(x)
        for x in blocks:
            eager(x)
    source = "\n".join(code)
    assert "flashquant.compress_into" in source
    assert not re.search(r"empty_strided\w*\(\(2, 2, 64", source), "a store-sized buffer in the graph"
    assert torch.equal(compiled.packed, eager.packed)
    assert torch.equal(compiled.norms.nan_to_num(), eager.norms.nan_to_num())
    assert int(compiled.count) == 24 and (compiled.packed[:, :, 24:] == POISON_BYTE).all()
