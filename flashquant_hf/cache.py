"""TurboQuantCache: a transformers ``Cache`` whose full-attention layers keep K/V TurboQuant-compressed.

The cache only builds and types its layers: :class:`~flashquant_hf.layer.TurboQuantLayer` for full attention,
transformers' own exact layers for sliding-window / chunked attention. Constructing one installs the attention
routing of :mod:`flashquant_hf.registration` (idempotent; :func:`flashquant_hf.uninstall` undoes it).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from .config import TurboQuantConfig, field_names
from .layer import TurboQuantLayer
from .registration import install
from .static_layer import StaticTurboQuantLayer, check_capacity

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

logger = logging.getLogger(__name__)

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Layers without attention: transformers gives them a placeholder layer (5.24: "dummy"; 5.17: "moe"/"mlp").
NO_ATTENTION_LAYER_TYPES = ("dummy", "moe", "mlp")


def layer_types_of(model_config: "PreTrainedConfig") -> list[tuple[str, dict]]:
    """(layer_type, layer kwargs) per decoder layer of ``model_config``; ValueError for what TurboQuant cannot serve."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = model_config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", type(text).__name__)
    if getattr(text, "kv_lora_rank", None) is not None:
        raise ValueError(
            f"TurboQuantCache cannot serve model_type {model_type!r}: its layers use multi-head latent attention "
            f"(MLA, kv_lora_rank={text.kv_lora_rank}), whose cached K/V are not per-head vectors of one head_dim"
        )
    if getattr(text, "num_kv_shared_layers", 0) or getattr(text, "kv_sharing_modes", None):
        raise ValueError(
            f"TurboQuantCache cannot serve model_type {model_type!r}: layers that share another layer's K/V "
            "(num_kv_shared_layers / kv_sharing_modes) are not supported"
        )
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    if isinstance(layer_kwargs, dict):  # transformers 5.17: one kwargs dict for every layer
        layer_kwargs = [layer_kwargs] * len(layer_types)
    for idx, layer_type in enumerate(layer_types):
        if layer_type not in ATTENTION_LAYER_TYPES + NO_ATTENTION_LAYER_TYPES:
            raise ValueError(
                f"TurboQuantCache cannot serve layer {idx} of model_type {model_type!r}: layer type {layer_type!r} "
                f"is not one of {ATTENTION_LAYER_TYPES} (linear-attention, state-space and sparse-indexed layers "
                "keep no per-token K/V to compress)"
            )
    return list(zip(layer_types, layer_kwargs))


def cache_kwargs(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{"cache": cache}`` for a model whose ``forward`` takes ``cache`` (transformers >= 5.2x, where
    ``past_key_values`` is deprecated), else ``{"past_key_values": cache}`` (5.17); for ``forward`` and ``generate``.

    >>> # model.generate(input_ids, **cache_kwargs(model, TurboQuantCache()))
    """
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _checked_capacity(max_cache_len: Any, config: TurboQuantConfig) -> int | None:
    """``max_cache_len`` after checking it and what the static mode needs of ``config``; None stays None."""
    if max_cache_len is None:
        return None
    check_capacity(max_cache_len)
    if config.outlier_channels or config.key_qjl:
        raise ValueError(
            "the static mode (`max_cache_len`) stores plain codes only; got outlier_channels="
            f"{config.outlier_channels}, key_qjl={config.key_qjl} (use TurboQuantCache() without max_cache_len)"
        )
    return max_cache_len


def _exact_nbytes(layer) -> int:
    """Bytes of a transformers layer's exact ``keys`` and ``values`` (tensors of the tokens it holds)."""
    tensors = (getattr(layer, name, None) for name in ("keys", "values"))
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class TurboQuantCache(Cache):
    """A transformers Cache whose full-attention layers are :class:`TurboQuantLayer`.

    Sliding-window / chunked layers stay exact in transformers' own ``DynamicSlidingWindowLayer`` (they are
    bounded). Without ``model_config`` the layers are built lazily at the first update, like ``DynamicCache()``,
    and the layer types are learnt from the model during the first forward.

    Parameters
    ----------
    config : TurboQuantConfig, or a transformers model config (then taken as ``model_config``)
    model_config : the model's config, to build every layer up front (and reject unsupported models at once)
    max_cache_len : None (default): layers grow with the sequence. An int: the static mode, every layer holds at
        most this many tokens in tensors allocated at the first prefill, the decode step has fixed shapes and no
        host synchronisation, and ``generate`` compiles it on CUDA (``is_compileable``), as for transformers'
        ``StaticCache``. One prefill into an empty cache, then one token per step; plain codes only.
    **overrides : TurboQuantConfig fields, e.g. ``bits=3, residual_length=0``

    >>> cache = TurboQuantCache(bits=4, residual_length=128)
    >>> # model.generate(input_ids, cache=cache)  # transformers 5.17: past_key_values=cache
    """

    def __init__(
        self,
        config: "TurboQuantConfig | PreTrainedConfig | None" = None,
        *,
        model_config: "PreTrainedConfig | None" = None,
        max_cache_len: int | None = None,
        **overrides: Any,
    ):
        from transformers import PreTrainedConfig

        if isinstance(config, PreTrainedConfig):
            config, model_config = None, config
        if config is not None and not isinstance(config, TurboQuantConfig):
            raise TypeError(
                f"`config` must be a TurboQuantConfig or a transformers config, got {type(config).__name__}"
            )
        unknown = sorted(set(overrides) - set(field_names()))
        if unknown:
            raise TypeError(
                f"TurboQuantCache() got unknown setting(s) {unknown}; its settings are the TurboQuantConfig fields "
                f"{field_names()} (and `model_config`)"
            )
        if config is None:
            config = TurboQuantConfig(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self.static_capacity = _checked_capacity(max_cache_len, config)
        self._layer_types = layer_types_of(model_config) if model_config is not None else None
        self._announced = False
        self._past_recording: dict[str, Any] | None = None  # activate_past_recording's arguments, for later layers
        install()
        if self._layer_types is None:
            replicate = TurboQuantLayer if self.static_capacity is None else StaticTurboQuantLayer
            super().__init__(layer_class_to_replicate=replicate)
        else:
            super().__init__(layers=[self._make_layer(idx) for idx in range(len(self._layer_types))])

    def __repr__(self) -> str:
        return f"TurboQuantCache(config={self.config}, layers={self.layers})"

    def _make_layer(self, idx: int):
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

        layer_type, kwargs = ("full_attention", {})
        if self._layer_types is not None and idx < len(self._layer_types):
            layer_type, kwargs = self._layer_types[idx]
        static = self.static_capacity is not None
        if layer_type == "full_attention":
            if static:
                return StaticTurboQuantLayer(self.config, self.static_capacity, layer_idx=idx, cache=self)
            return TurboQuantLayer(self.config, layer_idx=idx, cache=self)
        if layer_type in ("sliding_attention", "chunked_attention"):
            if static:
                window = kwargs["sliding_window"]
                layer = StaticSlidingWindowLayer(max_cache_len=self.static_capacity, sliding_window=window)
            else:
                layer = DynamicSlidingWindowLayer(sliding_window=kwargs["sliding_window"])
        elif static:
            from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING

            layer = STATIC_LAYER_TYPE_MAPPING[layer_type](max_cache_len=self.static_capacity, **kwargs)
        else:
            layer = DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)
        if self._past_recording is not None and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording(**self._past_recording)
        return layer

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile the decode step: the static mode (``max_cache_len`` set), whose layers
        all have fixed shapes, also before they are built lazily at the first forward."""
        if self.static_capacity is None:
            return False
        return all(getattr(layer, "is_compileable", False) for layer in self.layers)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Make every layer that drops past states (sliding windows) keep them until the next ``crop``, as
        transformers' ``Cache`` does, including the layers this cache builds later (lazily, or when it learns the
        model's layer types during the first forward). ``kwargs`` are passed on as given (transformers >= 5.2x
        passes ``recurrent_states_to_keep``; 5.17 passes nothing)."""
        self._past_recording = kwargs
        super().activate_past_recording(**kwargs)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update layer ``layer_idx`` (built on first use); a failed call leaves the cache as it was."""
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"`layer_idx` must be an integer >= 0, got {layer_idx!r}")
        count = len(self.layers)
        while len(self.layers) <= layer_idx:
            self.layers.append(self._make_layer(len(self.layers)))
        try:
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        except Exception:
            del self.layers[count:]
            raise

    @property
    def nbytes(self) -> int:
        """Bytes the cache allocates: compressed stores, exact windows and sinks at their capacity, means, sliding
        layers. Above :attr:`stored_nbytes` by at most 31 compressed tokens per layer and the exact window's spare
        room (a window left in blocks of 64 is allocated for the R + 63 tokens it holds at most)."""
        layers = self.layers
        return sum(layer.nbytes if isinstance(layer, TurboQuantLayer) else _exact_nbytes(layer) for layer in layers)

    @property
    def stored_nbytes(self) -> int:
        """Bytes of what the cache holds: its tokens (codes, exact sinks, windows, sliding layers) and means."""
        return sum(
            layer.stored_nbytes if isinstance(layer, TurboQuantLayer) else _exact_nbytes(layer) for layer in self.layers
        )

    # ---- learning the model's layer types during the first forward (cache built without model_config)
    def adopt_model_config(
        self, model_config: "PreTrainedConfig", layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """Type the layers from ``model_config`` (once); ``key_states``/``value_states``: exact K/V of ``layer_idx``.

        Layers already built as TurboQuantLayer but meant to be sliding are converted when their exact K/V are
        still known (this layer's first prefill, or nothing compressed yet); an unsupported model raises a
        ValueError and leaves the cache empty.
        """
        if self._layer_types is not None:
            return
        try:
            layer_types = layer_types_of(model_config)
        except ValueError:
            self.layers.clear()
            raise
        self._layer_types = layer_types
        for idx, layer in enumerate(self.layers):
            if idx >= len(layer_types) or layer_types[idx][0] == "full_attention":
                continue
            if not isinstance(layer, TurboQuantLayer):
                continue
            if idx == layer_idx:
                exact = (key_states, value_states)
            elif not layer.is_initialized or layer.get_seq_length() == 0:
                exact = None
            elif layer.num_compressed == 0:
                exact = layer.exact_states()
            else:
                logger.info("layer %d stays a TurboQuantLayer: its compressed tokens cannot be made exact", idx)
                continue
            fresh = self._make_layer(idx)
            if exact is not None and exact[0].shape[2]:
                fresh.update(*exact)
            self.layers[idx] = fresh

    def announce(self, implementation_name: str) -> None:
        """Log once which layers run the flashquant attention."""
        if self._announced:
            return
        self._announced = True
        indices = [i for i, layer in enumerate(self.layers) if isinstance(layer, TurboQuantLayer)]
        logger.info(
            "flashquant: attention of layers %s now runs over the TurboQuant cache (model attention %r)",
            indices, implementation_name,
        )

    # ---- what a TurboQuantCache cannot hold
    def _no_linear_attention(self, method: str):
        raise NotImplementedError(
            f"TurboQuantCache holds attention layers only; the model called `{method}`, i.e. it has linear-attention "
            "or state-space layers (e.g. Mamba, Qwen3-Next), which TurboQuantCache cannot serve"
        )

    def update_conv_state(self, *args, **kwargs):
        """Not supported: linear-attention / SSM layers keep no K/V."""
        self._no_linear_attention("update_conv_state")

    def update_recurrent_state(self, *args, **kwargs):
        """Not supported: linear-attention / SSM layers keep no K/V."""
        self._no_linear_attention("update_recurrent_state")

    def get_conv_state(self, *args, **kwargs):
        """Not supported: linear-attention / SSM layers keep no K/V."""
        self._no_linear_attention("get_conv_state")

    def get_recurrent_state(self, *args, **kwargs):
        """Not supported: linear-attention / SSM layers keep no K/V."""
        self._no_linear_attention("get_recurrent_state")

    def has_previous_state(self, *args, **kwargs):
        """Not supported: linear-attention / SSM layers keep no K/V."""
        self._no_linear_attention("has_previous_state")

    def update_indexer(self, *args, **kwargs):
        """Not supported: sparse-indexed attention (DeepSeek-V3.2 style) keeps an extra indexer cache."""
        raise NotImplementedError("TurboQuantCache does not support sparse-indexed attention layers (`update_indexer`)")
