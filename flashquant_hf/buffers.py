"""TokenBuffer: tensors that share a growing token axis, appended to in place (the storage of a TurboQuantLayer)."""

from __future__ import annotations

from typing import Callable

import torch


class TokenBuffer:
    """Tensors ``[B, H, capacity, ...]`` sharing the token axis (dim 2); live tokens are ``[start, start + length)``.

    Appends write in place. When the tokens do not fit, the capacity grows to the tokens needed rounded up to a
    whole number of ``block`` tokens (at most ``max_capacity`` unless more is needed): the allocation never exceeds
    what is held by a block or more, and a growth allocates the new capacity and copies the live tokens once.
    Dropping tokens from the front only moves ``start``; the live range is moved back to the front when the end is
    reached.
    """

    def __init__(self, block: int = 1, max_capacity: int | None = None):
        if block < 1:
            raise ValueError(f"`block` must be an integer >= 1, got {block!r}")
        self.block = block
        self.max_capacity = max_capacity
        self.tensors = ()
        self.start = 0
        self.length = 0

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers, ``[B, H, capacity, ...]`` each."""
        return self._tensors

    @tensors.setter
    def tensors(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._tensors = tensors
        # (start, length) and the views of the live tokens; dropped with the tensors, whose memory they would hold
        self._live: tuple[tuple[int, int], tuple[torch.Tensor, ...]] | None = None

    @property
    def capacity(self) -> int:
        """Tokens the tensors can hold."""
        return self.tensors[0].shape[2] if self.tensors else 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not only the live tokens)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the live tokens."""
        return sum(t.numel() * t.element_size() for t in self.views())

    def views(self) -> tuple[torch.Tensor, ...]:
        """The live tokens of every tensor (views, shape ``[B, H, length, ...]``): the same tuple until the buffer
        changes, so a reader can key what it derives from them on it (a decode step reads a layer's store views
        several times; the store changes once per window block)."""
        live = (self.start, self.length)
        if self._live is None or self._live[0] != live:
            self._live = live, tuple(t[:, :, self.start : self.start + self.length] for t in self.tensors)
        return self._live[1]

    def _new_capacity(self, need: int) -> int:
        grown = -(-need // self.block) * self.block
        if self.max_capacity is not None:
            grown = min(grown, self.max_capacity)
        return max(grown, need)

    def _make_writable(self) -> None:
        # Tensors made under torch.inference_mode() cannot be written in place outside it (a cache prefilled in
        # inference mode, then decoded under no_grad): copy them once into ordinary tensors.
        if self.tensors and self.tensors[0].is_inference() and not torch.is_inference_mode_enabled():
            self.tensors = tuple(t.clone() for t in self.tensors)

    def reserve(self, count: int, like: tuple[torch.Tensor, ...]) -> None:
        """Make room for ``count`` more tokens at the end (``like``: one example tensor per buffer)."""
        self._make_writable()
        need = self.length + count
        if self.tensors and self.start + need <= self.capacity:
            return
        if self.tensors and need <= self.capacity:
            for t in self.tensors:
                live = t[:, :, self.start : self.start + self.length]
                # Overlapping source and destination would make copy_ undefined.
                t[:, :, : self.length].copy_(live.clone() if self.start < self.length else live)
            self.start = 0
            return
        capacity = self._new_capacity(need)
        fresh = tuple(
            torch.empty((*x.shape[:2], capacity, *x.shape[3:]), dtype=x.dtype, device=x.device) for x in like
        )
        for new, old in zip(fresh, self.views()):
            new[:, :, : self.length].copy_(old)
        self.tensors, self.start = fresh, 0

    def append(self, *parts: torch.Tensor) -> None:
        """Write ``parts`` (one ``[B, H, n, ...]`` tensor per buffer) after the live tokens."""
        count = parts[0].shape[2]
        if count == 0:
            return
        self.reserve(count, parts)
        end = self.start + self.length
        for t, part in zip(self.tensors, parts):
            t[:, :, end : end + count].copy_(part)
        self.length += count

    def drop_front(self, count: int) -> None:
        """Forget the ``count`` oldest live tokens."""
        self.start += count
        self.length -= count

    def drop_back(self, count: int) -> None:
        """Forget the ``count`` newest live tokens."""
        self.length -= count

    def reorder(self, index: torch.Tensor) -> None:
        """Permute the batch of the live tokens in place (``index`` has one entry per batch row)."""
        self._make_writable()
        for t in self.tensors:
            live = t[:, :, self.start : self.start + self.length]
            live.copy_(live.index_select(0, index.to(t.device)))

    def rebatch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every tensor by ``fn(live tokens)`` (a new batch size), keeping the capacity."""
        if not self.tensors:
            return
        capacity = self.capacity
        fresh = []
        for live in self.views():
            new_live = fn(live)
            t = torch.empty((*new_live.shape[:2], capacity, *new_live.shape[3:]), dtype=live.dtype, device=live.device)
            t[:, :, : self.length].copy_(new_live)
            fresh.append(t)
        self.tensors, self.start = tuple(fresh), 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> None:
        """Move every tensor to ``device``."""
        self.tensors = tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors)
