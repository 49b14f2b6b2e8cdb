import numpy as np
import pytest
import torch

from flashquant_hf.rotation import hadamard_signs, random_rotation


@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
@pytest.mark.parametrize("seed", [0, 7])
def test_haar_rotation_is_orthogonal(head_dim, seed):
    pi = random_rotation(head_dim, seed)
    assert pi.dtype == torch.float32 and pi.shape == (head_dim, head_dim)
    eye = torch.eye(head_dim)
    assert (pi @ pi.T - eye).abs().max() < 1e-5
    assert (pi.T @ pi - eye).abs().max() < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hadamard_rotation_is_orthogonal_and_matches_its_signs(head_dim, gen):
    pi = random_rotation(head_dim, 3, "hadamard")
    assert (pi @ pi.T - torch.eye(head_dim)).abs().max() < 1e-5
    signs = hadamard_signs(head_dim, 3)
    assert set(signs.tolist()) <= {-1.0, 1.0}
    # Pi = H diag(s) / sqrt(D): rotating x equals a Walsh-Hadamard transform of s * x
    x = torch.randn(5, head_dim, dtype=torch.float64, generator=gen)
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(head_dim)] for i in range(head_dim)],
                     dtype=torch.float64)
    expected = (signs.double() * x) @ h.T / np.sqrt(head_dim)
    torch.testing.assert_close(x @ pi.double().T, expected, rtol=0, atol=1e-6)


def test_same_seed_same_matrix_everywhere():
    """PCG64 + LAPACK QR: the matrix for a seed is pinned by value, not just repeatable in-process."""
    a, b = random_rotation(128, 11), random_rotation(128, 11)
    assert torch.equal(a, b)
    assert not torch.allclose(a, random_rotation(128, 12))
    # Values recorded once; they only depend on NumPy's PCG64 stream and the Householder QR with sign fix.
    expected_corner = torch.tensor([[0.0027878, 0.1217905], [-0.0342337, 0.0290997]])
    torch.testing.assert_close(random_rotation(128, 11)[:2, :2], expected_corner, rtol=0, atol=1e-6)


def test_rotation_distribution_is_haar_like():
    """The first coordinate of Pi @ e_1 over many seeds has variance 1/D and mean 0 (no sign bias)."""
    values = torch.stack([random_rotation(16, s)[0, 0] for s in range(2000)]).double()
    assert abs(values.mean().item()) < 4 * (1 / 16) ** 0.5 / 2000**0.5
    assert values.var().item() == pytest.approx(1 / 16, rel=0.1)


@pytest.mark.parametrize("kind,head_dim", [("hadamard", 96), ("nope", 64)])
def test_bad_arguments(kind, head_dim):
    with pytest.raises(ValueError, match="rotation|power-of-two"):
        random_rotation(head_dim, 0, kind)
