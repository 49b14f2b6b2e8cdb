"""What ``TurboQuantLayer.update`` attaches to the K/V it returns, for the attention of the same step to read.

transformers hands the attention function only what ``cache.update`` returned, never the cache. So the layer sets
the attribute :data:`TAG` on those tensors: a :class:`FirstPrefillTag` on the exact K/V of a layer's first update,
a :class:`CompressedPlan` on the exact window once something is compressed. This module is shared by the layer
(:mod:`flashquant_hf.layer`), the attention (:mod:`flashquant_hf.attention`) and the routing
(:mod:`flashquant_hf.registration`), and imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layer import TurboQuantLayer

TAG = "_flashquant"  # attribute set on the K/V tensors that update() returns


@dataclass(frozen=True)
class CompressedPlan:
    """What the attention of one step must do: read ``layer`` (whose state had these counts at update time)."""

    layer: "TurboQuantLayer"
    num_sink: int
    num_compressed: int
    num_window: int

    def check_current(self) -> None:
        """Raise unless the layer still holds exactly what update() returned."""
        layer = self.layer
        now = (layer.num_sink, layer.num_compressed, layer.num_window)
        if now != (self.num_sink, self.num_compressed, self.num_window):
            raise RuntimeError(
                f"TurboQuantLayer {layer.layer_idx} changed between update() and the attention "
                f"(sinks/compressed/window {self.num_sink}/{self.num_compressed}/{self.num_window} -> "
                f"{now[0]}/{now[1]}/{now[2]}); the K/V returned by update() are valid for one attention call only"
            )


@dataclass(frozen=True)
class FirstPrefillTag:
    """Marks the exact K/V returned by a layer's first update, so the attention can learn the model's layer types."""

    layer: "TurboQuantLayer"


@dataclass(frozen=True, eq=False)
class StaticPlan:
    """Marks the tensors a static-capacity layer returns from every decode step: the attention reads ``layer``'s
    fixed-size buffers and device counters (the tensors themselves hold nothing)."""

    layer: "TurboQuantLayer"
