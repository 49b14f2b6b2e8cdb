"""StaticTurboQuantLayer: a TurboQuantLayer of fixed capacity whose decode step has fixed shapes and no host
decision, so ``torch.compile`` (and CUDA graphs) can capture it.

Storage, allocated once at the first prefill for ``max_cache_len`` tokens and written in place afterwards::

    exact_k / exact_v   [B, H, S + R + block, D]  slots [0, S): the sinks; [S, S + R + block): the window, a ring
    store               [B, H, N_c + block, ...]  the compressed tokens (N_c = max_cache_len - S - R), then one
                                                  block of scratch slots that absorbs the writes of steps that
                                                  compress nothing (slots rounded up to a multiple of
                                                  16); per side codes and norms, or one buffer of rows
                                                  ``codes | norm`` (store_layout.inline_norms)
    counts              int64 [4]                 sinks, compressed, ring start, window tokens (device)

A decode step writes the new token into the first free sink slot (while the sinks are not full and nothing else
is held) or at the ring's end; when the window then holds ``R + block`` tokens, its oldest ``block`` are
compressed into the store and leave the ring. Every step runs the same kernels: the block is always compressed,
and written either to the next store slots or to the scratch slots, as the device counters say. The token layout
and what is compressed when are those of :class:`~flashquant_hf.layer.TurboQuantLayer` (the dynamic mode), so
both modes hold the same codes for the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import TurboQuantConfig
from .custom_ops import compress_into
from .layer import TurboQuantLayer
from .packing import packed_size
from .store_layout import NORM_BYTES, split_rows
from .tags import TAG, FirstPrefillTag, StaticPlan

COUNTS = ("sinks", "compressed", "ring_start", "window")  # the entries of StaticTurboQuantLayer.counts
# The store's slots per (sequence, head), rounded up to a multiple of 16: every run of rows and norms then starts
# 16-byte aligned, which the staged decode's bulk copies need (otherwise it reads with register loads, slower).
STORE_SLOT_MULTIPLE = 16


def check_capacity(max_cache_len: Any) -> int:
    """``max_cache_len`` if it is an integer >= 1, else a ValueError naming it."""
    if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
        raise ValueError(f"`max_cache_len` must be an integer >= 1 or None, got {max_cache_len!r}")
    return max_cache_len


def static_store_capacity(config: TurboQuantConfig, max_cache_len: int) -> int:
    """Compressed tokens a static layer of ``max_cache_len`` tokens can hold: once a window has been compressed from,
    it keeps at least ``residual_length`` tokens and the sinks are full."""
    return max(0, max_cache_len - config.sink_tokens - config.residual_length)


class StaticTurboQuantLayer(TurboQuantLayer):
    """A :class:`~flashquant_hf.layer.TurboQuantLayer` of fixed capacity (``max_cache_len`` tokens) for
    ``torch.compile``: one multi-token prefill into an empty layer, then one token per step."""

    is_compileable = True
    is_croppable = False

    def __init__(self, config: TurboQuantConfig | None = None, max_cache_len: int | None = None, **kwargs: Any):
        """``max_cache_len``: the capacity in tokens; ``layer_idx``, ``cache`` as for TurboQuantLayer."""
        self.max_cache_len = check_capacity(max_cache_len)
        super().__init__(config, **kwargs)

    def __repr__(self) -> str:
        return f"StaticTurboQuantLayer(layer_idx={self.layer_idx}, max_cache_len={self.max_cache_len})"

    # ---- state
    def _reset_state(self) -> None:
        self.key_mean = self.value_mean = None
        self.key_order = self.value_order = None  # split codes are refused in the static mode
        self._pending = None
        self.prefilled = False  # host flag: False until the first prefill (then the decode step's shapes are fixed)
        self._host_tokens = 0  # tokens held, counted by eager steps only (capacity check outside compiled code)

    @property
    def window_capacity(self) -> int:
        """Slots of the window ring: ``residual_length + window_block``."""
        return self.config.residual_length + self.config.window_block

    @property
    def store_capacity(self) -> int:
        """Compressed tokens the store can hold (without its scratch block)."""
        return static_store_capacity(self.config, self.max_cache_len)

    def _allocate(self, key_states: torch.Tensor) -> None:
        """The fixed-size tensors, once per shape (kept by :meth:`reset`: their addresses stay valid for graphs).
        Ordinary tensors even under ``torch.inference_mode()``, so a cache prefilled there can decode under
        ``no_grad`` (writing in place into an inference tensor outside inference mode is an error)."""
        with torch.inference_mode(False):
            self._allocate_tensors(key_states)

    def _allocate_tensors(self, key_states: torch.Tensor) -> None:
        cfg = self.config
        batch, heads, _, head_dim = key_states.shape
        dev, dtype = key_states.device, key_states.dtype
        exact_slots = cfg.sink_tokens + self.window_capacity
        slots = -(-(self.store_capacity + cfg.window_block) // STORE_SLOT_MULTIPLE) * STORE_SLOT_MULTIPLE
        key_bytes, value_bytes = packed_size(head_dim, cfg.key_bits), packed_size(head_dim, cfg.value_bits)
        self.exact_k = torch.zeros((batch, heads, exact_slots, head_dim), dtype=dtype, device=dev)
        self.exact_v = torch.zeros_like(self.exact_k)
        store: list[torch.Tensor] = []
        for row_bytes, inline in zip((key_bytes, value_bytes), self.norms_inline):
            if inline:
                store.append(torch.zeros((batch, heads, slots, row_bytes + NORM_BYTES), dtype=torch.uint8, device=dev))
            else:
                store.append(torch.zeros((batch, heads, slots, row_bytes), dtype=torch.uint8, device=dev))
                store.append(torch.zeros((batch, heads, slots), dtype=torch.float32, device=dev))
        self.store_tensors = tuple(store)
        self.counts = torch.zeros(len(COUNTS), dtype=torch.int64, device=dev)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=dev)  # compressed tokens per row, for the kernel
        self.key_mean = torch.zeros((batch, heads, head_dim), device=dev) if cfg.key_centering else None
        self.value_mean = torch.zeros((batch, heads, head_dim), device=dev) if cfg.value_centering else None
        self.block_offsets = torch.arange(cfg.window_block, device=dev)
        self.exact_slots = torch.arange(exact_slots, device=dev)
        tables = {}
        for side, codec in (("key", self.key_codec), ("value", self.value_codec)):
            tq = codec.quantizer
            tables[side] = (tq.rotation(dev), tq.boundaries(dev), tq.centroids(dev), tq.hadamard_signs(dev))
        self.tables = tables
        # update() returns these two tensors in every decode step; the tag tells the attention which layer they
        # belong to (set once, outside any compiled code).
        self.route_k, self.route_v = self.exact_k[:, :, :0], self.exact_v[:, :, :0]
        plan = StaticPlan(self)
        setattr(self.route_k, TAG, plan)
        setattr(self.route_v, TAG, plan)
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs read and write them in place
            tables = [t for side in tables.values() for t in side]
            for t in (self.exact_k, self.exact_v, *self.store_tensors, self.counts, self.lengths, self.key_mean,
                      self.value_mean, self.block_offsets, self.exact_slots, *tables):
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    def _matches(self, key_states: torch.Tensor) -> bool:
        return (
            getattr(self, "exact_k", None) is not None
            and tuple(self.exact_k.shape[:2]) == tuple(key_states.shape[:2])
            and self.exact_k.shape[3] == key_states.shape[3]
            and self.exact_k.dtype == key_states.dtype
            and self.exact_k.device == key_states.device
        )

    # ---- counts (host reads synchronise: tests, repr and the dynamic layer's helpers only)
    @property
    def num_sink(self) -> int:
        """Exact sink tokens held."""
        return int(self.counts[0]) if self.prefilled else 0

    @property
    def num_compressed(self) -> int:
        """Compressed tokens held."""
        return int(self.counts[1]) if self.prefilled else 0

    @property
    def num_window(self) -> int:
        """Exact window tokens held."""
        return int(self.counts[3]) if self.prefilled else 0

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds (allocated capacity)."""
        if not self.is_initialized or getattr(self, "exact_k", None) is None:
            return 0
        tensors = (self.exact_k, self.exact_v, *self.store_tensors, self.key_mean, self.value_mean)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def stored_nbytes(self) -> int:
        """Bytes of what this layer holds: the codes of its compressed tokens, its exact sink and window tokens, and
        the centring means (synchronises)."""
        if not self.prefilled:
            return 0
        per_token = sum(t[0, 0, 0].numel() * t.element_size() for t in self.store_tensors) * self.batch_size
        exact = self.exact_k[:, :, 0].numel() * self.exact_k.element_size() * 2
        means = sum(t.numel() * t.element_size() for t in (self.key_mean, self.value_mean) if t is not None)
        return self.num_compressed * per_token * self.num_heads + (self.num_sink + self.num_window) * exact + means

    # ---- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first call (an empty layer) stores a prefill of up to ``max_cache_len`` tokens and returns its exact
        K/V; every later call takes one token and returns the layer's routing tensors for the attention."""
        if not torch.compiler.is_compiling():
            self._check_states(key_states, value_states)
            self._check_static_call(key_states)
        with torch.no_grad():
            if not self.prefilled:
                return self._prefill(key_states, value_states)
            self._decode_store(key_states, value_states)
            return self.route_k, self.route_v

    def _check_static_call(self, key_states: torch.Tensor) -> None:
        count = key_states.shape[2]
        if not self.prefilled:
            if count > self.max_cache_len:
                raise ValueError(
                    f"the prompt holds {count} tokens, more than this static TurboQuantCache's max_cache_len="
                    f"{self.max_cache_len}; create it with a larger max_cache_len"
                )
            return
        if count != 1:
            raise NotImplementedError(
                f"a static TurboQuantCache (max_cache_len set) takes one multi-token prefill into an empty cache, "
                f"then one token per step; got {count} tokens after the prefill (chunked prefill, assisted "
                "generation and multi-turn reuse need the dynamic mode: TurboQuantCache() without max_cache_len, "
                "or cache.reset() before a new prompt)"
            )
        if self._host_tokens + 1 > self.max_cache_len:
            raise ValueError(
                f"this static TurboQuantCache is full: it holds max_cache_len={self.max_cache_len} tokens; create it "
                "with a larger max_cache_len"
            )
        self._host_tokens += 1

    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the first K/V of an empty layer, as the dynamic layer would (sinks, whole blocks compressed, the rest
        in the window), and return them exact for the model's own attention."""
        cfg = self.config
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._matches(key_states):
            self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
            self.dtype, self.device = key_states.dtype, key_states.device
            self._allocate(key_states)
        count = key_states.shape[2]
        if count and self.key_mean is not None:
            self.key_mean.copy_(key_states.float().mean(dim=2))
        if count and self.value_mean is not None:
            self.value_mean.copy_(value_states.float().mean(dim=2))
        to_sinks = min(cfg.sink_tokens, count)
        rest = count - to_sinks
        compressed = max(0, rest - cfg.residual_length)
        compressed -= compressed % cfg.window_block
        window = rest - compressed
        self.exact_k[:, :, :to_sinks].copy_(key_states[:, :, :to_sinks])
        self.exact_v[:, :, :to_sinks].copy_(value_states[:, :, :to_sinks])
        if compressed:
            self._compress_into(key_states[:, :, to_sinks : to_sinks + compressed],
                                value_states[:, :, to_sinks : to_sinks + compressed],
                                torch.zeros((), dtype=torch.int64, device=self.device))
        ring = slice(cfg.sink_tokens, cfg.sink_tokens + window)
        self.exact_k[:, :, ring].copy_(key_states[:, :, to_sinks + compressed :])
        self.exact_v[:, :, ring].copy_(value_states[:, :, to_sinks + compressed :])
        self.counts.copy_(torch.tensor([to_sinks, compressed, 0, window], dtype=torch.int64))
        self.lengths.fill_(compressed)
        self.prefilled = True
        self._host_tokens = count
        setattr(key_states, TAG, FirstPrefillTag(self))
        return key_states, value_states

    def _compress_into(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> None:
        """Compress ``[B, H, n, D]`` K/V (after centring) straight into store slots ``start .. start + n`` (``start``:
        an int64 device scalar)."""
        (kp, kn), (vp, vn) = self.store_sides()
        for side, x, mean, packed, norms, codec in (
            ("key", keys, self.key_mean, kp, kn, self.key_codec),
            ("value", values, self.value_mean, vp, vn, self.value_codec),
        ):
            rotation, boundaries, centroids, signs = self.tables[side]
            tq = codec.quantizer
            compress_into(self._centred(x, mean), rotation, boundaries, centroids, signs, tq.bits, tq.norm_correction,
                          self.backend, packed, norms, start)  # norms None: packed holds inline norms

    def _decode_store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One token in, device counters only: the sinks or the ring take it; a full window compresses its oldest
        block into the store (or, every other step, into the scratch slots)."""
        cfg = self.config
        sinks_cap, ring_cap, block = cfg.sink_tokens, self.window_capacity, cfg.window_block
        n_sink, n_comp, start, n_win = self.counts.clone().unbind()  # values, not views of what is rewritten below
        to_sink = (n_sink < sinks_cap) & (n_comp + n_win == 0)
        slot = torch.where(to_sink, n_sink, sinks_cap + (start + n_win) % ring_cap)
        self.exact_k.index_copy_(2, slot.reshape(1), key_states)
        self.exact_v.index_copy_(2, slot.reshape(1), value_states)
        n_sink = n_sink + to_sink.long()
        n_win = n_win + (~to_sink).long()
        full = (n_win == ring_cap) & (n_comp + block <= self.store_capacity)
        ring_slots = sinks_cap + (start + self.block_offsets) % ring_cap
        oldest_k = self.exact_k.index_select(2, ring_slots)
        oldest_v = self.exact_v.index_select(2, ring_slots)
        self._compress_into(oldest_k, oldest_v, torch.where(full, n_comp, self.store_capacity))
        moved = full.long() * block
        self.counts.copy_(torch.stack([n_sink, n_comp + moved, (start + moved) % ring_cap, n_win - moved]))
        self.lengths.copy_((n_comp + moved).to(torch.int32).expand_as(self.lengths))

    # ---- views (tests and debugging; they synchronise)
    def _ring_order(self) -> torch.Tensor:
        start, n_win = int(self.counts[2]), int(self.counts[3])
        return self.config.sink_tokens + (start + torch.arange(n_win, device=self.device)) % self.window_capacity

    def sink_states(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact sink K/V, or None when there are none."""
        n = self.num_sink
        return (self.exact_k[:, :, :n], self.exact_v[:, :, :n]) if n else None

    def window_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact window K/V, oldest first (copies)."""
        order = self._ring_order()
        return self.exact_k.index_select(2, order), self.exact_v.index_select(2, order)

    def exact_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks followed by the window (``[B, H_kv, S + W, D]`` each)."""
        n = self.num_sink
        window_k, window_v = self.window_states()
        return (torch.cat([self.exact_k[:, :, :n], window_k], dim=2),
                torch.cat([self.exact_v[:, :, :n], window_v], dim=2))

    def store_sides(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """``((k_packed, k_norms), (v_packed, v_norms))``, the whole store; a side with inline norms is
        ``(rows, None)``."""
        tensors = iter(self.store_tensors)
        return tuple((next(tensors), None if inline else next(tensors)) for inline in self.norms_inline)

    def compressed_views(self) -> tuple[torch.Tensor, ...]:
        """Views of the compressed tokens ``(k_packed, k_norms, v_packed, v_norms)``, ``[B, H_kv, N_c, ...]``."""
        n = self.num_compressed
        views: tuple[torch.Tensor, ...] = ()
        for packed, norms in self.store_sides():
            views += split_rows(packed[:, :, :n]) if norms is None else (packed[:, :, :n], norms[:, :, :n])
        return views

    def key_views(self) -> tuple[torch.Tensor, ...]:
        """The key code's tensors of the compressed tokens."""
        return self.compressed_views()[:2]

    def value_views(self) -> tuple[torch.Tensor, ...]:
        """The value code's tensors of the compressed tokens."""
        return self.compressed_views()[2:]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V the cache stands for, compressed tokens rebuilt (tests and debugging only)."""
        if not self.prefilled:
            raise ValueError(f"StaticTurboQuantLayer {self.layer_idx} holds no tokens yet")
        n = self.num_sink
        window_k, window_v = self.window_states()
        parts_k, parts_v = [self.exact_k[:, :, :n].to(dtype)], [self.exact_v[:, :, :n].to(dtype)]
        if self.num_compressed:
            k, v = self._decode_compressed(dtype)
            parts_k.append(k)
            parts_v.append(v)
        parts_k.append(window_k.to(dtype))
        parts_v.append(window_v.to(dtype))
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    # ---- CacheLayerMixin API
    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens held, as a device tensor (like transformers' StaticLayer); 0 before the first prefill."""
        if not self.prefilled:
            return 0
        return self.counts[0] + self.counts[1] + self.counts[3]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask: the prefill's own tokens, then the whole capacity (fixed shapes)."""
        if not self.prefilled:
            return query_length, 0
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        """The capacity, ``max_cache_len``."""
        return self.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """Not supported in the static mode."""
        raise NotImplementedError(
            "a static TurboQuantCache cannot be cropped (assisted generation needs the dynamic mode: "
            "TurboQuantCache() without max_cache_len)"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search, in place (``beam_idx`` holds one source row per row)."""
        if not self.prefilled:
            return
        self._check_beam_index(beam_idx)
        index = beam_idx.to(self.device)
        for t in (self.exact_k, self.exact_v, *self.store_tensors, self.key_mean, self.value_mean):
            if t is not None:
                t.copy_(t.index_select(0, index))

    def _no_rebatch(self, name: str) -> None:
        raise NotImplementedError(
            f"a static TurboQuantCache keeps its batch size (`{name}`); use the dynamic mode "
            "(TurboQuantCache() without max_cache_len)"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported in the static mode (the batch size is fixed)."""
        self._no_rebatch("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Not supported in the static mode (the batch size is fixed)."""
        self._no_rebatch("batch_select_indices")

    def reset(self) -> None:
        """Forget every token; the tensors stay allocated (same addresses) for a next prompt of the same shape."""
        if getattr(self, "counts", None) is not None:
            self.counts.zero_()
            self.lengths.zero_()
        self.prefilled = False
        self.is_initialized = False  # the next prefill may bring another shape (same shape: same tensors)
        self._host_tokens = 0
        self._pending = None

    def offload(self) -> None:
        """Not supported in the static mode (compiled graphs hold the tensors' addresses)."""
        raise NotImplementedError("a static TurboQuantCache cannot be offloaded")

    def prefetch(self) -> None:
        """Nothing to do: a static layer stays on its device."""
