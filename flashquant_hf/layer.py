"""TurboQuantLayer: one full-attention layer of a TurboQuantCache, its K/V kept TurboQuant-compressed.

Token layout (positions grow to the right)::

    [ sinks (exact, first S tokens) | compressed (TQ, N_c tokens) | window (exact, newest <= R tokens) ]

New tokens fill the sinks first, then enter the window; tokens that age out of the window are compressed
*before* the attention of the step that pushed them out (decode-faithful). The compressed part is the contiguous
layout of docs/ARCHITECTURE.md: ``k_packed [B, H_kv, N_cap, nbytes] uint8``, ``k_norms [B, H_kv, N_cap] fp32``
(same for V), or, for a side :func:`~flashquant_hf.store_layout.inline_norms` picks, one buffer of rows
``codes | norm``; growing in blocks of ``STORE_BLOCK`` tokens. The attention over it lives in
:mod:`flashquant_hf.attention`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from . import ops
from .backend import resolve_backend
from .buffers import TokenBuffer
from .codec import head_codec, split_problem
from .config import TurboQuantConfig
from .quantizer import FLOAT_DTYPES, TurboQuantizer
from .store_layout import inline_norms, joined_rows, split_rows
from .tags import TAG, CompressedPlan, FirstPrefillTag

# The compressed store grows by whole blocks of tokens: at most 31 tokens allocated beyond those held (<= 3% from
# 1K tokens on), a multiple of 16 tokens keeps every row of the packed layout 16-byte aligned. A growth copies the
# layer's live codes once (one growth per 32 compressed tokens: per window block of 64, or per 32 decode steps
# when every token is compressed).
STORE_BLOCK = 32
WINDOW_SLACK = 64  # extra window capacity: the live range is moved to the front once every 64 tokens
# Per-sequence statistics of a layer, taken on its first prefill: [B, H, D] each, or None when not used.
SEQUENCE_STATS = ("key_mean", "value_mean", "key_order", "value_order")


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _layout(t: torch.Tensor) -> list[int]:
    """Dimensions of ``t`` from the largest stride to the smallest (its memory layout)."""
    return sorted(range(t.dim()), key=lambda dim: (-t.stride(dim), dim))


def _in_layout(t: torch.Tensor, layout: list[int]) -> torch.Tensor:
    """``t`` copied into memory laid out as ``layout`` (a reduction over it then runs in that layout's order)."""
    return t.permute(layout).contiguous().permute([layout.index(dim) for dim in range(t.dim())])


class TurboQuantLayer(CacheLayerMixin):
    """One full-attention layer: exact sinks, a TurboQuant-compressed middle and an exact residual window."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(
        self,
        config: TurboQuantConfig | None = None,
        layer_idx: int | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ):
        # CacheLayerMixin.__init__ would assign `keys`/`values`, which this layer does not have.
        self.config = config if config is not None else TurboQuantConfig()
        self.layer_idx = layer_idx
        self._cache_ref = weakref.ref(cache) if cache is not None else None
        self.is_initialized = False
        self._reset_state()

    def __repr__(self) -> str:
        return (
            f"TurboQuantLayer(layer_idx={self.layer_idx}, tokens={self.get_seq_length()}, sinks={self.num_sink}, "
            f"compressed={self.num_compressed}, window={self.num_window})"
        )

    # ---- no full-precision tensors
    @property
    def keys(self):
        """Not available: keys are stored compressed (use :meth:`dequantize` to rebuild them, for tests)."""
        raise AttributeError(
            "TurboQuantLayer stores its keys compressed and has no full-precision `keys` tensor; "
            "use `dequantize()` to rebuild an approximation"
        )

    @property
    def values(self):
        """Not available: values are stored compressed (use :meth:`dequantize` to rebuild them, for tests)."""
        raise AttributeError(
            "TurboQuantLayer stores its values compressed and has no full-precision `values` tensor; "
            "use `dequantize()` to rebuild an approximation"
        )

    # ---- state
    def _reset_state(self) -> None:
        cfg = self.config
        self.sinks = TokenBuffer(max_capacity=cfg.sink_tokens)
        self.store = TokenBuffer(block=STORE_BLOCK)
        # The exact parts grow token by token as they fill (a short prompt costs what DynamicCache's exact K/V cost,
        # no more). A full window holds up to R + window_block - 1 tokens. The slack lets the oldest ones be dropped
        # 64 times between two moves of the live range; a block of up to 65 fits in the same slack (one move per
        # block), so the default block costs no memory.
        self.window = TokenBuffer(max_capacity=cfg.residual_length + max(cfg.window_block - 1, WINDOW_SLACK))
        self.key_mean: torch.Tensor | None = None  # centring means, fp32
        self.value_mean: torch.Tensor | None = None
        self.key_order: torch.Tensor | None = None  # channel orders of split codes (outlier channels first)
        self.value_order: torch.Tensor | None = None
        # The first prefill's token count and K/V memory layouts, until its statistics are taken: when its first
        # token is compressed (until then its tokens are all held exact, and a cache that compresses nothing
        # holds nothing but exact tokens).
        self._first_prefill: tuple[int, list[int], list[int]] | None = None
        self._stats_taken = False
        self._pending: CompressedPlan | None = None
        self._store_sides: tuple[tuple[torch.Tensor, ...], tuple[tuple[torch.Tensor, ...], ...]] | None = None

    @property
    def num_sink(self) -> int:
        """Exact sink tokens held."""
        return self.sinks.length

    @property
    def num_compressed(self) -> int:
        """Compressed tokens held."""
        return self.store.length

    @property
    def num_window(self) -> int:
        """Exact window tokens held."""
        return self.window.length

    @property
    def nbytes(self) -> int:
        """Bytes allocated by this layer (compressed store, sinks and window at their capacity, per-sequence
        statistics)."""
        return sum(buffer.nbytes for buffer in self._buffers()) + self._stats_nbytes()

    @property
    def stored_nbytes(self) -> int:
        """Bytes of what this layer holds: its tokens (codes, exact sinks and window) and per-sequence statistics."""
        return sum(buffer.stored_nbytes for buffer in self._buffers()) + self._stats_nbytes()

    @property
    def compressed_token_nbytes(self) -> int | None:
        """Bytes one compressed token takes (every batch row and KV head; codes and norms), None before the first."""
        return self.store.stored_nbytes // self.num_compressed if self.num_compressed else None

    def _stats_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stats().values() if t is not None)

    def _stats(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in SEQUENCE_STATS}

    def _map_stats(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name, t in self._stats().items():
            if t is not None:
                setattr(self, name, fn(t))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Record batch, heads, head_dim, dtype and device from the first K/V; decide the backend (``"cuda"`` or
        ``"torch"``, from ``config.backend`` and the device) once; build the codecs."""
        cfg = self.config
        try:
            backend = resolve_backend(key_states, value_states, requested=cfg.backend)
        except RuntimeError as error:  # backend='cuda' without CUDA tensors or CuPy: raised before anything is set
            raise RuntimeError(f"TurboQuantCache(backend={cfg.backend!r}): {error}") from None
        self.backend = backend
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_codec = head_codec(
            self.head_dim, cfg.key_bits, cfg.key_seed, cfg.rotation, cfg.norm_correction, cfg.outlier_channels,
            cfg.key_qjl,
        )
        self.value_codec = head_codec(
            self.head_dim, cfg.value_bits, cfg.value_seed, cfg.rotation, cfg.norm_correction, cfg.outlier_channels,
            False,
        )
        # (keys, values): whether the store keeps the side's norms after its code rows (plain codes only)
        self.norms_inline = inline_norms(self.head_dim, cfg.key_bits, cfg.value_bits) if self.is_plain else (
            False, False)
        self.is_initialized = True

    @property
    def is_plain(self) -> bool:
        """Whether keys and values use the plain code the CUDA kernels read (no outlier channels, no QJL)."""
        return self.key_codec.is_plain and self.value_codec.is_plain

    def _check_states(self, key_states: Any, value_states: Any) -> None:
        """Raise a ValueError/TypeError naming the problem; nothing is modified."""
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"`{name}` must have shape [batch, kv_heads, tokens, head_dim], got {_shape(t)}")
            if t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"`{name}` must be float16, bfloat16 or float32, got {_shape(t)}")
        if key_states.shape[-1] != value_states.shape[-1]:
            raise ValueError(
                f"TurboQuantCache needs keys and values of the same head_dim, got key_states {_shape(key_states)} "
                f"and value_states {_shape(value_states)} (multi-head latent attention such as DeepSeek-V3 "
                "is not supported)"
            )
        if key_states.shape[:3] != value_states.shape[:3] or key_states.dtype != value_states.dtype:
            raise ValueError(
                f"`key_states` and `value_states` must match in batch, heads, tokens and dtype, got "
                f"{_shape(key_states)} and {_shape(value_states)}"
            )
        if key_states.device != value_states.device:
            raise ValueError(
                f"`key_states` and `value_states` must be on one device, got {key_states.device} and "
                f"{value_states.device}"
            )
        head_dim = key_states.shape[-1]
        if head_dim < 4 or head_dim % 2:
            raise ValueError(f"TurboQuantCache needs an even head_dim >= 4, got `key_states` {_shape(key_states)}")
        if self.config.rotation == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(
                f"`rotation='hadamard'` needs a power-of-two head_dim, got `key_states` {_shape(key_states)}; "
                "use rotation='haar'"
            )
        cfg = self.config
        problem = split_problem(head_dim, cfg.outlier_channels, cfg.key_qjl, cfg.rotation)
        if problem is not None:
            raise ValueError(f"{problem} (`key_states` {_shape(key_states)})")
        if self.is_initialized:
            expected = [self.batch_size, self.num_heads, head_dim]
            got = [key_states.shape[0], key_states.shape[1], self.head_dim]
            if got != expected or key_states.dtype != self.dtype or key_states.device != self.device:
                raise ValueError(
                    f"layer {self.layer_idx} holds batch={self.batch_size}, kv_heads={self.num_heads}, "
                    f"head_dim={self.head_dim}, {self.dtype} on {self.device}; got `key_states` "
                    f"{_shape(key_states)} on {key_states.device} (call `reset()` to start a new sequence)"
                )
        if self._pending is not None:
            raise RuntimeError(
                f"the previous compressed K/V of TurboQuantLayer {self.layer_idx} never reached the flashquant "
                "attention: the model's attention implementation must be 'sdpa', 'eager' or 'turboquant' (another "
                "one, or any after `flashquant_hf.uninstall()`, would have attended to the exact window only). If "
                "the previous forward raised an error, "
                "call `cache.reset()` before reusing the cache."
            )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V (shape ``[B, H_kv, L, D]``) and return what the attention of this step needs.

        Returns the exact K/V of the whole sequence while nothing is compressed (the attention is then the
        model's own); otherwise the exact window, tagged with a :class:`CompressedPlan` for the flashquant
        attention. Tokens pushed out of the window are compressed before this returns.
        """
        self._check_states(key_states, value_states)
        with torch.no_grad():  # the cache is inference-only: stored tensors must not keep autograd history
            return self._store(key_states, value_states)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cfg = self.config
        was_empty = self.get_seq_length() == 0
        count = key_states.shape[2]
        first_prefill = count and not self._stats_taken and self._first_prefill is None
        if first_prefill:
            self._first_prefill = (count, _layout(key_states), _layout(value_states))

        to_sinks = min(cfg.sink_tokens - self.num_sink, count) if self.num_compressed + self.num_window == 0 else 0
        self.sinks.append(key_states[:, :, :to_sinks], value_states[:, :, :to_sinks])
        rest_k, rest_v = key_states[:, :, to_sinks:], value_states[:, :, to_sinks:]
        overflow = max(0, self.num_window + rest_k.shape[2] - cfg.residual_length)
        overflow -= overflow % cfg.window_block  # whole blocks only: the window keeps R to R + block - 1 tokens
        from_window = min(self.num_window, overflow)
        from_new = overflow - from_window
        if overflow and first_prefill:
            self._take_stats(key_states, value_states)
        elif overflow:
            self._take_stats()
        if from_window:
            old_k, old_v = self.window.views()
            self._compress(old_k[:, :, :from_window], old_v[:, :, :from_window])
            self.window.drop_front(from_window)
        if from_new:
            self._compress(rest_k[:, :, :from_new], rest_v[:, :, :from_new])
        self.window.append(rest_k[:, :, from_new:], rest_v[:, :, from_new:])

        if was_empty:
            setattr(key_states, TAG, FirstPrefillTag(self))
            return key_states, value_states
        if self.num_compressed == 0:
            return self.exact_states()
        plan = CompressedPlan(self, self.num_sink, self.num_compressed, self.num_window)
        self._pending = plan
        window_k, window_v = self.window.views() if self.window.tensors else self._empty_window(key_states)
        setattr(window_k, TAG, plan)
        setattr(window_v, TAG, plan)
        return window_k, window_v

    def _take_stats(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """The per-sequence statistics of the first prefill (``keys``/``values``: its K/V when they are at hand, else
        read back from the exact tokens in the prefill's memory layout, which makes the reductions, and so the
        statistics, bit-identical)."""
        if self._stats_taken or self._first_prefill is None:
            return
        count, key_layout, value_layout = self._first_prefill
        if keys is None:
            exact_k, exact_v = self.exact_states()
            keys = _in_layout(exact_k[:, :, :count], key_layout)
            values = _in_layout(exact_v[:, :, :count], value_layout)
        cfg = self.config
        if cfg.key_centering:
            self.key_mean = keys.float().mean(dim=2)
        if cfg.value_centering:
            self.value_mean = values.float().mean(dim=2)
        if cfg.outlier_channels:
            self.key_order = self.key_codec.channel_order(self._centred(keys, self.key_mean))
            self.value_order = self.value_codec.channel_order(self._centred(values, self.value_mean))
        self._first_prefill, self._stats_taken = None, True

    def _empty_window(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        empty = like.new_empty((self.batch_size, self.num_heads, 0, self.head_dim))
        return empty, empty.clone()

    @staticmethod
    def _centred(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        return x if mean is None else x.float() - mean[:, :, None, :]

    def _compress(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Compress ``[B, H, n, D]`` K/V (after centring) and append them to the store."""
        key_code = self.key_codec.encode(self._centred(keys, self.key_mean), self.key_order, self._run_compress)
        value_code = self.value_codec.encode(
            self._centred(values, self.value_mean), self.value_order, self._run_compress
        )
        key_inline, value_inline = self.norms_inline
        self.store.append(*(joined_rows(*key_code),) if key_inline else key_code,
                          *(joined_rows(*value_code),) if value_inline else value_code)

    def _run_compress(self, tq: TurboQuantizer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = x.device
        return ops.compress(
            x, tq.rotation(dev), tq.boundaries(dev), tq.bits, tq.centroids(dev), tq.norm_correction,
            tq.hadamard_signs(dev), backend=self.backend, split_code=not self.is_plain,
        )

    def consume_plan(self, plan: CompressedPlan) -> None:
        """Called by the attention: the plan returned by the last update() is being served."""
        plan.check_current()
        if self._pending is plan:
            self._pending = None

    # ---- views for the attention
    def exact_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks followed by the window, concatenated (contiguous ``[B, H_kv, S + W, D]`` each)."""
        parts = [views for views in (self.sinks.views(), self.window.views()) if views and views[0].shape[2]]
        if not parts:
            shape = (self.batch_size, self.num_heads, 0, self.head_dim)
            empty = torch.empty(shape, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    def sink_states(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact sink K/V (views), or None when there are none."""
        return self.sinks.views() if self.num_sink else None

    def compressed_views(self) -> tuple[torch.Tensor, ...]:
        """Views of the compressed tokens (``[B, H_kv, N_c, ...]``): the key code's tensors, then the value code's;
        ``(k_packed, k_norms, v_packed, v_norms)`` for plain codes (inline norms as views of their rows)."""
        keys, values = self._side_views()
        return keys + values

    def key_views(self) -> tuple[torch.Tensor, ...]:
        """The key code's tensors of the compressed tokens (see :class:`~flashquant_hf.codec.HeadCodec`)."""
        return self._side_views()[0]

    def value_views(self) -> tuple[torch.Tensor, ...]:
        """The value code's tensors of the compressed tokens."""
        return self._side_views()[1]

    def _side_views(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(key code's tensors, value code's tensors) of the compressed tokens, made once per state of the store (the
        host time of a decode step is the model's speed in eager mode)."""
        views = self.store.views()
        if self._store_sides is not None and self._store_sides[0] is views:
            return self._store_sides[1]
        key_count = 1 if self.norms_inline[0] else self.key_codec.tensor_count
        sides = (views[:key_count], views[key_count:])
        sides = tuple(split_rows(side[0]) if inline and side else side
                      for side, inline in zip(sides, self.norms_inline))
        self._store_sides = views, sides
        return sides

    def _decode_compressed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed tokens' K/V rebuilt, centring means added back, in ``dtype``."""
        k = self.key_codec.decode(self.key_views(), self.key_order)
        v = self.value_codec.decode(self.value_views(), self.value_order)
        if self.key_mean is not None:
            k = k + self.key_mean[:, :, None, :]
        if self.value_mean is not None:
            v = v + self.value_mean[:, :, None, :]
        return k.to(dtype), v.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V the cache stands for, ``[B, H_kv, N, D]``, compressed tokens rebuilt (tests and debugging only).

        This rebuilds the whole context in full precision; the attention never does.
        """
        parts_k, parts_v = [], []
        if self.num_sink:
            sk, sv = self.sinks.views()
            parts_k.append(sk.to(dtype))
            parts_v.append(sv.to(dtype))
        if self.num_compressed:
            k, v = self._decode_compressed(dtype)
            parts_k.append(k)
            parts_v.append(v)
        if self.num_window:
            wk, wv = self.window.views()
            parts_k.append(wk.to(dtype))
            parts_v.append(wv.to(dtype))
        if not parts_k:
            if not self.is_initialized:
                raise ValueError(f"TurboQuantLayer {self.layer_idx} holds no tokens yet")
            empty = torch.empty((self.batch_size, self.num_heads, 0, self.head_dim), dtype=dtype, device=self.device)
            return empty, empty.clone()
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    # ---- CacheLayerMixin API
    def get_seq_length(self) -> int:
        """Tokens held (sinks + compressed + window)."""
        return self.num_sink + self.num_compressed + self.num_window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask: every past token plus the new ones, from position 0."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: the layer grows without bound."""
        return -1

    def get_max_cache_shape(self) -> int:
        """-1 (transformers < 5.16 name of :meth:`get_max_length`)."""
        return self.get_max_length()

    def _buffers(self) -> tuple[TokenBuffer, ...]:
        return (self.sinks, self.store, self.window)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the ``-tokens_to_remove`` newest tokens (a negative count, as in transformers 5.x).

        A positive value follows the installed transformers' ``DynamicLayer.crop``: 5.17 keeps the first
        ``tokens_to_remove`` tokens (deprecated there), later versions raise. Tokens that had already aged into the
        compressed part stay compressed after a crop.
        """
        if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.numel() == 1:
            tokens_to_remove = int(tokens_to_remove)  # transformers 5.17's assisted decoding passes a tensor
        if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool):
            raise TypeError(f"`tokens_to_remove` must be an int, got {type(tokens_to_remove).__name__}")
        if tokens_to_remove > 0:
            remaining = self._positive_crop(tokens_to_remove)
        else:
            remaining = min(-tokens_to_remove, self.get_seq_length())
        if self._first_prefill is not None and self.get_seq_length() - remaining < self._first_prefill[0]:
            self._take_stats()  # the crop removes tokens of the first prefill: its statistics are taken before
        for buffer in (self.window, self.store, self.sinks):
            drop = min(remaining, buffer.length)
            buffer.drop_back(drop)
            remaining -= drop
        self._pending = None

    def _positive_crop(self, tokens_to_keep: int) -> int:
        """Tokens that ``crop(tokens_to_keep)`` removes under the installed transformers' ``DynamicLayer.crop``
        contract, found by running it on a layer of meta tensors (shapes only, no data); ValueError where that
        contract refuses positive values."""
        length = self.get_seq_length()
        probe = DynamicLayer()
        probe.keys = probe.values = torch.empty((1, 1, length, 1), device="meta")
        probe.is_initialized = True
        try:
            probe.crop(tokens_to_keep)
        except ValueError:
            raise ValueError(
                f"`crop` takes a negative number of tokens to remove, got {tokens_to_keep}; "
                f"use `crop({tokens_to_keep - length})` to keep the first {tokens_to_keep} tokens"
            ) from None
        return length - probe.keys.shape[-2]

    def _check_batch_index(self, name: str, index: torch.Tensor) -> None:
        if not isinstance(index, torch.Tensor) or index.dim() != 1:
            raise ValueError(f"`{name}` must be a 1-D tensor, got {index!r}")

    def _check_beam_index(self, beam_idx: torch.Tensor) -> None:
        """``beam_idx`` of :meth:`reorder_cache`: a 1-D tensor of one source row per batch row."""
        self._check_batch_index("beam_idx", beam_idx)
        if beam_idx.shape[0] != self.batch_size:
            raise ValueError(f"`beam_idx` must have {self.batch_size} entries, got {beam_idx.shape[0]}")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search (``beam_idx`` holds one source row per row)."""
        if not self.is_initialized:
            return
        self._check_beam_index(beam_idx)
        for buffer in self._buffers():
            buffer.reorder(beam_idx)
        self._map_stats(lambda t: t.index_select(0, beam_idx.to(t.device)))
        self._pending = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (contrastive search, assisted decoding)."""
        if not self.is_initialized:
            return
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"`repeats` must be an integer >= 1, got {repeats!r}")
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices``."""
        if not self.is_initialized:
            return
        self._check_batch_index("indices", indices)
        self._rebatch(lambda t: t[indices.to(t.device)])

    def _rebatch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._store_sides = None
        for buffer in self._buffers():
            buffer.rebatch(fn)
        self._map_stats(fn)
        self.batch_size = fn(torch.zeros((self.batch_size, 1), device=self.device)).shape[0]
        self._pending = None

    def reset(self) -> None:
        """Forget every token (the next update starts a new sequence, possibly of another shape)."""
        self._reset_state()
        self.is_initialized = False

    def offload(self) -> None:
        """Move this layer's tensors to the CPU."""
        self._move("cpu")

    def prefetch(self) -> None:
        """Move this layer's tensors back to its device."""
        if self.is_initialized:
            self._move(self.device)

    def _move(self, device) -> None:
        self._store_sides = None  # views of the old tensors would keep their memory
        for buffer in self._buffers():
            buffer.to(device, non_blocking=True)
        self._map_stats(lambda t: t.to(device, non_blocking=True))
