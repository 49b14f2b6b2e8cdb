"""The attention masks transformers passes, as additive fp32 biases, and the causal structure they are checked
against (:mod:`flashquant_hf.attention`)."""

from __future__ import annotations

import torch

ROW_BLOCK = 256  # query rows per block when a multi-token chunk's mask is checked


def check_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """The 4D mask as ``[B or 1, Lq, kv_len]`` (a view), after checking its shape; None stays None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"the flashquant attention takes a 4D tensor mask or None, got {type(attention_mask).__name__}"
        )
    shape = list(attention_mask.shape)
    if (
        attention_mask.dim() != 4
        or shape[0] not in (1, batch)
        or shape[1] != 1
        or shape[2] != q_len
        or shape[3] != kv_len
    ):
        raise ValueError(
            f"`attention_mask` must have shape [{batch} or 1, 1, {q_len}, {kv_len}] (queries x every cached token); "
            f"got {shape} (per-head masks are not supported)"
        )
    return attention_mask[:, 0]


def as_bias(mask: torch.Tensor) -> torch.Tensor:
    """An additive fp32 bias (0 where visible, -inf where masked) from a mask slice.

    Boolean masks (sdpa) mark visible keys with True; float masks (eager) are additive, with values at or
    below half the dtype's minimum meaning "masked".
    """
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float().masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))


def mask_to_bias(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """:func:`as_bias` of the whole checked mask, ``[B, Lq, kv_len]`` fp32 (tests and small masks)."""
    mask = check_mask(attention_mask, batch, q_len, kv_len)
    return None if mask is None else as_bias(mask).expand(batch, q_len, kv_len)


def causal_visible(q_len: int, kv_len: int, diagonal: int, device: torch.device) -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: query i sees key j iff ``j <= diagonal + i``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + diagonal
    return torch.arange(kv_len, device=device).unsqueeze(0) <= rows


def bias_from(visible: torch.Tensor) -> torch.Tensor:
    """fp32 additive bias of a bool visibility mask (0 visible, -inf hidden)."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


def is_regular(mask: torch.Tensor, cols: slice, key_bias: torch.Tensor, diagonal: int | None) -> bool:
    """Whether every row of ``mask[:, :, cols]`` is ``key_bias`` restricted by the causal structure.

    ``diagonal``: query i sees compressed key j iff ``j <= diagonal + i`` (None: no causal structure). Checked in
    blocks of rows so a long chunk never materialises a float copy of the whole mask block.
    """
    q_len, n_keys = mask.shape[1], cols.stop - cols.start
    for r0 in range(0, q_len, ROW_BLOCK):
        r1 = min(q_len, r0 + ROW_BLOCK)
        block = as_bias(mask[:, r0:r1, cols])
        expected = key_bias[: block.shape[0], None, :].expand(block.shape[0], r1 - r0, n_keys)
        if diagonal is not None:
            expected = expected.masked_fill(
                ~causal_visible(r1 - r0, n_keys, diagonal + r0, mask.device), float("-inf")
            )
        if not torch.equal(block, expected):
            return False
    return True
