"""What the compress and decompress kernel tests share: the bad arguments both wrappers check the same way."""

from __future__ import annotations

import torch

# Factories, not tensors: collection must not touch CUDA on machines without a GPU. Each case's overrides apply
# to the test's good arguments at head_dim 128, 4 bits.
CODEBOOK_AND_ROTATION_BAD_INPUTS = [
    (lambda: dict(rotation=torch.eye(64, device="cuda")), ValueError, r"`rotation` must have shape \[128, 128\]"),
    (lambda: dict(bits=5), ValueError, r"`bits` must be one of"),
    (lambda: dict(centroids=torch.zeros(8, device="cuda")), ValueError, r"`centroids` must have shape \[16\]"),
    (lambda: dict(hadamard_signs=torch.ones(64, device="cuda")), ValueError,
     r"`hadamard_signs` must have shape \[128\]"),
]
