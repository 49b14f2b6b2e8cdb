"""Lloyd-Max codebooks: converged, correct for the sphere marginal, and the expected distortion."""

import numpy as np
import pytest
import torch

from flashquant_hf.codebook import lloyd_max_codebook

# Lloyd-Max distortion of a unit vector, summed over coordinates, in the high-dimensional (Gaussian) limit.
DESIGN_D_MSE = {1: 0.3634, 2: 0.1175, 3: 0.0345, 4: 0.0095}


def _cell_moments(head_dim: int, edges: np.ndarray, power: int) -> np.ndarray:
    """Integral of t^power * density over each cell by Gauss-Legendre quadrature (independent of the grid)."""
    nodes, weights = np.polynomial.legendre.leggauss(200)

    def density(t):
        return (1 - t * t) ** ((head_dim - 3) / 2)

    total = 0.0
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        t = 0.5 * (b - a) * nodes + 0.5 * (a + b)
        out.append(0.5 * (b - a) * np.sum(weights * density(t) * t**power))
    # normalise over [-1, 1] in many small pieces so the peaked density is integrated accurately
    fine = np.linspace(-1, 1, 4001)
    for a, b in zip(fine[:-1], fine[1:]):
        t = 0.5 * (b - a) * nodes + 0.5 * (a + b)
        total += 0.5 * (b - a) * np.sum(weights * density(t))
    return np.array(out) / total


# Small dims: the channel parts of codes with outlier channels (e.g. 4 of 16); a start outside the support once
# left 4-dim codebooks with empty cells and garbage centroids.
@pytest.mark.parametrize("head_dim", [4, 6, 12, 32, 64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_fixed_point(head_dim, bits):
    """Each centroid is the conditional mean of its cell and each boundary the midpoint of its neighbours."""
    cb = lloyd_max_codebook(head_dim, bits)
    assert cb.centroids.shape == (2**bits,) and cb.boundaries.shape == (2**bits - 1,)
    assert np.all(np.diff(cb.centroids) > 0)
    np.testing.assert_allclose(cb.boundaries, 0.5 * (cb.centroids[1:] + cb.centroids[:-1]), rtol=0, atol=1e-15)
    sd = 1 / np.sqrt(head_dim)
    edges = np.concatenate([[-1.0], cb.boundaries, [1.0]])
    # quadrature over [-1,1] is wasteful for the outer cells; cut them where the density is < 1e-30
    edges[0], edges[-1] = -min(1.0, 15 * sd), min(1.0, 15 * sd)
    mass = _cell_moments(head_dim, edges, 0)
    mean = _cell_moments(head_dim, edges, 1) / mass
    np.testing.assert_allclose(cb.centroids, mean, rtol=0, atol=1e-6 * sd)
    # symmetric density -> symmetric codebook
    np.testing.assert_allclose(cb.centroids, -cb.centroids[::-1], atol=1e-9 * sd)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_high_dimensional_limit_matches_design_figures(bits):
    """As D grows the marginal tends to N(0, 1/D) and D_mse to the Gaussian Lloyd-Max figures (within 0.5%)."""
    assert lloyd_max_codebook(8192, bits).mse_unit_vector == pytest.approx(DESIGN_D_MSE[bits], rel=0.005)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_exact_sphere_marginal_beats_gaussian_figures_slightly(bits):
    """At D=128 the exact marginal has lighter tails than N(0, 1/D): 1-2.5% less distortion, never more."""
    mse = lloyd_max_codebook(128, bits).mse_unit_vector
    assert DESIGN_D_MSE[bits] * 0.975 <= mse <= DESIGN_D_MSE[bits]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_mse_matches_sampled_unit_vectors(bits):
    """The codebook's predicted distortion equals a Monte Carlo estimate on exact sphere coordinates."""
    head_dim = 128
    cb = lloyd_max_codebook(head_dim, bits)
    g = torch.Generator().manual_seed(1234 + bits)
    x = torch.randn(20000, head_dim, generator=g, dtype=torch.float64)
    coords = (x / x.norm(dim=-1, keepdim=True)).flatten()
    idx = torch.bucketize(coords, torch.tensor(cb.boundaries), right=True)
    err = (coords - torch.tensor(cb.centroids)[idx]) ** 2
    assert err.mean().item() * head_dim == pytest.approx(cb.mse_unit_vector, rel=0.01)


@pytest.mark.parametrize("bad", [(127, 4), (0, 4), (128, 5), (128, 0)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="head_dim|bits"):
        lloyd_max_codebook(*bad)
