import pytest
import torch

from flashquant_hf import TurboQuantizer
from flashquant_hf.codebook import lloyd_max_codebook

DESIGN_D_MSE = {2: 0.1175, 3: 0.0345, 4: 0.0095}


def _unit_vectors(n, d, seed):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("rotation", ["haar", "hadamard"])
def test_d_mse_of_round_trip(bits, rotation, gen):
    """D_mse on random unit vectors at D=128: within 2% of the design figures and of the codebook's own value."""
    tq = TurboQuantizer(128, bits, seed=int(torch.randint(0, 1000, (), generator=gen)), rotation=rotation)
    x = _unit_vectors(40000, 128, seed=bits)
    mse = ((tq.decompress(tq.compress(x)) - x) ** 2).sum(-1).mean().item()
    assert mse == pytest.approx(DESIGN_D_MSE[bits], rel=0.025)
    assert mse == pytest.approx(lloyd_max_codebook(128, bits).mse_unit_vector, rel=0.02)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 64), (2, 1, 5, 128), (256,)])
def test_shapes_dtypes_and_nbytes(dtype, shape, gen):
    head_dim = shape[-1]
    tq = TurboQuantizer(head_dim, 4)
    x = torch.randn(shape, generator=gen).to(dtype)
    c = tq.compress(x)
    rows = x.numel() // head_dim
    assert c.nbytes == rows * (head_dim // 2 + 4)
    assert c.indices.shape == (*shape[:-1], head_dim // 2) and c.norms.shape == shape[:-1]
    assert c.norms.dtype == torch.float32
    y = tq.decompress(c)
    assert y.shape == x.shape and y.dtype == dtype
    assert tq.decompress(c, dtype=torch.float64).dtype == torch.float64
    cos = torch.nn.functional.cosine_similarity(y.float().reshape(-1, head_dim), x.float().reshape(-1, head_dim))
    assert cos.min() > 0.97


def test_norm_correction_keeps_the_exact_norm(gen):
    tq = TurboQuantizer(64, 3, norm_correction=True)
    x = torch.randn(500, 64, generator=gen) * 3
    y = tq.decompress(tq.compress(x))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_zero_vector_round_trips_to_zero():
    for correction in (False, True):
        tq = TurboQuantizer(64, 4, norm_correction=correction)
        c = tq.compress(torch.zeros(2, 64))
        assert torch.equal(c.norms, torch.zeros(2))
        y = tq.decompress(c)
        assert torch.equal(y, torch.zeros(2, 64))


def test_seeds_change_the_indices_but_not_the_quality(gen):
    x = torch.randn(200, 64, generator=gen)
    a, b = TurboQuantizer(64, 4, seed=0).compress(x), TurboQuantizer(64, 4, seed=1).compress(x)
    assert not torch.equal(a.indices, b.indices)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.ones(4, 63), r"\[\.\.\., 64\]"),
        (torch.ones(4, 64, dtype=torch.long), "float16, bfloat16 or float32"),
        (torch.tensor([[float("nan")] * 64]), "NaN or Inf"),
        (torch.tensor([[float("inf")] + [0.0] * 63]), "NaN or Inf"),
        (torch.tensor(1.0), "shape"),
    ],
)
def test_bad_input_raises(x, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantizer(64, 4).compress(x)


@pytest.mark.parametrize("kwargs, match", [({"head_dim": 63}, "even"), ({"head_dim": 64, "bits": 5}, "bits"),
                                           ({"head_dim": 64, "rotation": "dct"}, "rotation")])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantizer(**kwargs)


def test_decompress_checks_the_quantizer_matches(gen):
    c = TurboQuantizer(64, 4).compress(torch.randn(3, 64, generator=gen))
    with pytest.raises(ValueError, match="bits=3"):
        TurboQuantizer(64, 3).decompress(c)
