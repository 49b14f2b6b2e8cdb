"""Reference ``tq_prefill``: ``tq_attention`` for query chunks (the contract of the fused CUDA prefill in
``kernels/tq_prefill.py``). For any ``Lq >= 1`` the reference is
:func:`flashquant_hf.reference.tq_attention.tq_attention` itself: same parameters and results.

>>> out_rot, lse = tq_prefill(q_rot, kp, kn, vp, vn, kc, vc, 4, 4, 128 ** -0.5, causal=True)  # doctest: +SKIP
"""

from __future__ import annotations

from .tq_attention import tq_attention as tq_prefill

__all__ = ["tq_prefill"]
