"""Paged TurboQuant KV store: fixed-size blocks, a block table per sequence, slot-mapped appends (as in vLLM).

Byte layout (one tensor per layer, ``blocks [num_blocks, H_kv, head_block_bytes] uint8``). Inside a block, each
KV head owns one contiguous structure of arrays of ``block_size = bs`` tokens::

    offset 0                      K indices  [bs, kb]  uint8   (kb = ceil(D * k_bits / 8), MSB-first packing)
    offset bs*kb                  K norms    [bs]      fp32
    offset bs*(kb + 4)            V indices  [bs, vb]  uint8   (vb = ceil(D * v_bits / 8))
    offset bs*(kb + 4 + vb)       V norms    [bs]      fp32
    head_block_bytes = bs * (kb + vb + 8)

So a token costs ``kb + 4 + vb + 4`` bytes per head (D + 8 for TQ4: 136 B at D = 128), exactly the seed's
per-token record, regrouped so that every section starts 16-byte aligned (block_size >= 8) and the decode kernel
reads 16 consecutive keys of one head with 16-byte loads. Key ``n`` of a sequence lives in block
``block_table[seq, n >> log2(bs)]`` at row ``n & (bs - 1)``; a slot is ``block * bs + row``.

:class:`PagedTQCache` owns the blocks of ``num_layers`` layers, one :class:`BlockAllocator`, the host-side
block lists and lengths of its sequences, and the K/V quantizers that compress appended tokens
(``flashquant_hf.ops.compress``: the CUDA kernel on GPU). :meth:`PagedTQCache.decode` runs the paged decode
attention (``flashquant_hf.kernels.paged_decode`` on GPU, ``flashquant_hf.reference.paged_decode`` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .codebook import SUPPORTED_BITS
from .packing import packed_size
from .quantizer import FLOAT_DTYPES, TurboQuantizer

BLOCK_SIZES = (8, 16, 32, 64)


@dataclass(frozen=True)
class PagedLayout:
    """Geometry of one paged layer: block size, heads, head_dim and bit widths (see the module docstring)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    k_bits: int = 4
    v_bits: int = 4

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"`block_size` must be one of {BLOCK_SIZES}, got {self.block_size!r}")
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1:
            raise ValueError(f"`num_kv_heads` must be a positive integer, got {self.num_kv_heads!r}")
        if not isinstance(self.head_dim, int) or self.head_dim < 4 or self.head_dim % 2:
            raise ValueError(f"`head_dim` must be an even integer >= 4, got {self.head_dim!r}")
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in SUPPORTED_BITS:
                raise ValueError(f"`{name}` must be one of {SUPPORTED_BITS}, got {getattr(self, name)!r}")

    @property
    def log2_block_size(self) -> int:
        """``log2(block_size)``: kernels address pages with shifts."""
        return self.block_size.bit_length() - 1

    @property
    def k_bytes(self) -> int:
        """Packed key bytes per token per head."""
        return packed_size(self.head_dim, self.k_bits)

    @property
    def v_bytes(self) -> int:
        """Packed value bytes per token per head."""
        return packed_size(self.head_dim, self.v_bits)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs per KV head (indices and fp32 norms of K and V)."""
        return self.k_bytes + self.v_bytes + 8

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one head's section of one block."""
        return self.block_size * self.bytes_per_token

    @property
    def offsets(self) -> tuple[int, int, int, int]:
        """Byte offsets of (K indices, K norms, V indices, V norms) inside one head's block section."""
        bs = self.block_size
        return 0, bs * self.k_bytes, bs * (self.k_bytes + 4), bs * (self.k_bytes + 4 + self.v_bytes)

    def empty_blocks(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Uninitialised ``uint8 [num_blocks, H_kv, head_block_bytes]`` storage for one layer."""
        return torch.empty(num_blocks, self.num_kv_heads, self.head_block_bytes, dtype=torch.uint8, device=device)

    def sections(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of one layer's blocks: K indices ``[NB, H, bs, kb]``, K norms ``[NB, H, bs]`` fp32,
        V indices ``[NB, H, bs, vb]``, V norms ``[NB, H, bs]`` fp32 (no copies)."""
        self.check_blocks(blocks)
        bs, kb, vb = self.block_size, self.k_bytes, self.v_bytes
        o_ki, o_kn, o_vi, o_vn = self.offsets
        k_idx = blocks[..., o_ki : o_ki + bs * kb].unflatten(-1, (bs, kb))
        k_nrm = blocks[..., o_kn : o_kn + 4 * bs].view(torch.float32)
        v_idx = blocks[..., o_vi : o_vi + bs * vb].unflatten(-1, (bs, vb))
        v_nrm = blocks[..., o_vn : o_vn + 4 * bs].view(torch.float32)
        return k_idx, k_nrm, v_idx, v_nrm

    def check_blocks(self, blocks: torch.Tensor, name: str = "blocks") -> None:
        """Raise ValueError unless ``blocks`` is ``uint8 [NB, H_kv, head_block_bytes]`` with a contiguous row."""
        expected = f"uint8 of shape [num_blocks, {self.num_kv_heads}, {self.head_block_bytes}]"
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 3:
            got = f"{blocks.dtype} {list(blocks.shape)}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"`{name}` must be {expected}, got {got}")
        if tuple(blocks.shape[1:]) != (self.num_kv_heads, self.head_block_bytes):
            raise ValueError(f"`{name}` must be {expected}, got {list(blocks.shape)}")
        if blocks.stride(2) != 1 or blocks.stride(1) != self.head_block_bytes:
            raise ValueError(f"`{name}` must be contiguous within each block, got strides {blocks.stride()}")


class BlockAllocator:
    """Free list of ``num_blocks`` block ids; allocation is all-or-nothing."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"`num_blocks` must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Pop from the end so fresh caches hand out 0, 1, 2, ... (easy to read in tests).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks available."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` block ids, or RuntimeError (and nothing taken) when fewer are free."""
        if count < 0:
            raise ValueError(f"`count` must be >= 0, got {count}")
        if count > len(self._free):
            raise RuntimeError(f"out of KV blocks: {count} needed, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Return ``ids`` to the pool; ValueError (and nothing freed) if any is not allocated."""
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"cannot free blocks that are not allocated (or listed twice): {sorted(bad) or list(ids)}")
        for i in reversed(list(ids)):
            self._used.discard(i)
            self._free.append(i)


class PagedTQCache:
    """Paged TurboQuant KV cache for ``num_layers`` layers sharing one block pool and one block table.

    >>> cache = PagedTQCache(num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64)
    >>> seq = cache.add_sequence()
    >>> k = v = torch.randn(20, 2, 64)
    >>> slots = cache.append([seq], k, v)
    >>> cache.seq_len(seq), cache.block_table([seq]).shape
    (20, torch.Size([1, 2]))
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int = 4,
        num_layers: int = 1,
        device: torch.device | str = "cpu",
        k_quantizer: TurboQuantizer | None = None,
        v_quantizer: TurboQuantizer | None = None,
    ):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"`num_layers` must be a positive integer, got {num_layers!r}")
        k_quantizer = k_quantizer or TurboQuantizer(head_dim, bits, seed=0)
        v_quantizer = v_quantizer or TurboQuantizer(head_dim, bits, seed=1)
        for name, quantizer in (("k_quantizer", k_quantizer), ("v_quantizer", v_quantizer)):
            if quantizer.head_dim != head_dim:
                raise ValueError(f"`{name}` has head_dim {quantizer.head_dim}, the cache {head_dim}")
        self.layout = PagedLayout(block_size, num_kv_heads, head_dim, k_quantizer.bits, v_quantizer.bits)
        self.num_layers = num_layers
        self.k_quantizer, self.v_quantizer = k_quantizer, v_quantizer
        self.allocator = BlockAllocator(num_blocks)
        self.blocks = torch.zeros(
            num_layers, num_blocks, num_kv_heads, self.layout.head_block_bytes, dtype=torch.uint8, device=device
        )
        # The storage's own device ("cuda" -> "cuda:0"), so comparisons with input tensors' devices hold.
        self.device = self.blocks.device
        self._blocks_of: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        self._next_id = 0

    # -- sequences -------------------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Register an empty sequence and return its id."""
        seq = self._next_id
        self._next_id += 1
        self._blocks_of[seq] = []
        self._len[seq] = 0
        return seq

    def free_sequence(self, seq: int) -> None:
        """Release a sequence and its blocks."""
        self._check_seqs([seq])
        self.allocator.free(self._blocks_of[seq])
        del self._blocks_of[seq], self._len[seq]

    def seq_len(self, seq: int) -> int:
        """Tokens stored for ``seq``."""
        self._check_seqs([seq])
        return self._len[seq]

    def _check_seqs(self, seqs: Sequence[int]) -> None:
        unknown = [s for s in seqs if s not in self._len]
        if unknown:
            raise ValueError(f"unknown sequence ids {unknown}; known: {sorted(self._len)}")

    # -- writing ---------------------------------------------------------------------------------------------
    def reserve(self, seqs: Sequence[int], num_tokens: Sequence[int]) -> torch.Tensor:
        """Make room for ``num_tokens[i]`` new tokens of ``seqs[i]``; return their slots (int64 ``[sum]``).

        Blocks are allocated all at once, so a RuntimeError (out of blocks) leaves the cache unchanged.
        """
        self._check_seqs(seqs)
        if len(seqs) != len(num_tokens) or len(set(seqs)) != len(seqs):
            raise ValueError(f"`seqs` must be distinct and match `num_tokens`, got {list(seqs)} / {list(num_tokens)}")
        if any(n < 0 for n in num_tokens):
            raise ValueError(f"`num_tokens` must be >= 0, got {list(num_tokens)}")
        bs = self.layout.block_size
        needs = [-(-(self._len[s] + n) // bs) - len(self._blocks_of[s]) for s, n in zip(seqs, num_tokens)]
        fresh = self.allocator.allocate(sum(needs))
        slots: list[int] = []
        for seq, n, need in zip(seqs, num_tokens, needs):
            self._blocks_of[seq].extend(fresh[:need])
            fresh = fresh[need:]
            table = self._blocks_of[seq]
            start = self._len[seq]
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, start + n))
            self._len[seq] = start + n
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> None:
        """Compress ``k``, ``v`` (shape: [T, H_kv, D]) and store token i at ``slot_mapping[i]`` of ``layer``."""
        lay = self.layout
        shape = (slot_mapping.shape[0], lay.num_kv_heads, lay.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or tuple(x.shape) != shape:
                got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"`{name}` must be a float tensor of shape {list(shape)}, got {got}")
            if x.device != self.device:
                raise ValueError(f"`{name}` must be on {self.device}, got {x.device}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"`layer` must be in [0, {self.num_layers}), got {layer}")
        if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
            raise ValueError(f"`slot_mapping` must be int64 [T], got {slot_mapping.dtype} {list(slot_mapping.shape)}")
        k_packed, k_norms = self.k_quantizer.compress_tensors(k)
        v_packed, v_norms = self.v_quantizer.compress_tensors(v)
        block = torch.div(slot_mapping, lay.block_size, rounding_mode="floor")
        row = slot_mapping % lay.block_size
        k_idx, k_nrm, v_idx, v_nrm = lay.sections(self.blocks[layer])
        # Advanced indices on dims 0 and 2 around a slice: the result is [T, H, ...], matching the inputs.
        k_idx[block, :, row] = k_packed
        k_nrm[block, :, row] = k_norms
        v_idx[block, :, row] = v_packed
        v_nrm[block, :, row] = v_norms

    def append(self, seqs: Sequence[int], k: torch.Tensor, v: torch.Tensor, num_tokens: Sequence[int] | None = None
               ) -> torch.Tensor:
        """:meth:`reserve` + :meth:`write` for a one-layer cache. ``k``, ``v``: [T, H_kv, D], tokens of
        ``seqs`` in order (``num_tokens`` each; default: T for one sequence, 1 each for several)."""
        if self.num_layers != 1:
            raise ValueError("`append` is for one-layer caches; use `reserve` once and `write` per layer")
        if num_tokens is None:
            num_tokens = [k.shape[0]] if len(seqs) == 1 else [1] * len(seqs)
        if sum(num_tokens) != k.shape[0]:
            raise ValueError(f"`num_tokens` sums to {sum(num_tokens)} but `k` holds {k.shape[0]} tokens")
        lay = self.layout
        shape = (k.shape[0], lay.num_kv_heads, lay.head_dim)
        for name, x in (("k", k), ("v", v)):  # checked before reserving so a bad call changes nothing
            if tuple(x.shape) != shape or x.dtype not in FLOAT_DTYPES or x.device != self.device:
                raise ValueError(f"`{name}` must be a float tensor of shape {list(shape)} on {self.device}, "
                                 f"got {x.dtype} {list(x.shape)} on {x.device}")
        slots = self.reserve(seqs, num_tokens)
        self.write(slots, k, v)
        return slots

    # -- reading ---------------------------------------------------------------------------------------------
    def block_table(self, seqs: Sequence[int]) -> torch.Tensor:
        """int32 ``[len(seqs), max_blocks]`` block ids (unused entries 0)."""
        self._check_seqs(seqs)
        width = max([1] + [len(self._blocks_of[s]) for s in seqs])
        rows = [self._blocks_of[s] + [0] * (width - len(self._blocks_of[s])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def seq_lens(self, seqs: Sequence[int]) -> torch.Tensor:
        """int32 ``[len(seqs)]`` stored lengths."""
        self._check_seqs(seqs)
        return torch.tensor([self._len[s] for s in seqs], dtype=torch.int32, device=self.device)

    def decode(self, q: torch.Tensor, seqs: Sequence[int], layer: int = 0, scale: float | None = None,
               rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one query token per sequence over its cached tokens.

        q : shape [len(seqs), Hq, D]; rotated by the key rotation inside unless ``rotated``.
        Returns (out ``[len(seqs), Hq, D]`` fp32 in the original space, lse ``[len(seqs), Hq]`` fp32).
        """
        from . import ops

        lay = self.layout
        scale = lay.head_dim**-0.5 if scale is None else scale
        dev = self.device
        q_rot = q if rotated else (q.float() @ self.k_quantizer.rotation(dev).T).to(q.dtype)
        table, lens = self.block_table(seqs), self.seq_lens(seqs)
        impl = ops.implementation("paged_decode", q_rot, self.blocks)
        out_rot, lse = impl.paged_decode(
            q_rot, self.blocks[layer], table, lens, self.k_quantizer.centroids(dev), self.v_quantizer.centroids(dev),
            lay.k_bits, lay.v_bits, scale, lay.block_size, max(self._len[s] for s in seqs),
        )
        return out_rot @ self.v_quantizer.rotation(dev), lse
