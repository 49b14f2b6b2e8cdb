"""The shared tensor validators of the kernel wrappers (``flashquant_hf/kernels/checks.py``), on CPU tensors."""

import pytest
import torch

from flashquant_hf.kernels import checks


def test_each_property_names_the_argument_and_the_expectation():
    t = torch.zeros(2, 3, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"`k_packed` must be a torch.Tensor, got list"):
        checks.check_is_tensor("k_packed", [1])
    with pytest.raises(ValueError, match=r"`k_packed` must be a CUDA tensor .*got a tensor on cpu"):
        checks.check_cuda("k_packed", t)
    with pytest.raises(ValueError, match=r"`t` must be on meta \(like `q_rot`\), got cpu"):
        checks.check_device("t", t, torch.device("meta"), like="`q_rot`")
    with pytest.raises(ValueError, match=r"`t` must have dtype float32, got float16"):
        checks.check_dtype("t", t, (torch.float32,))
    with pytest.raises(TypeError, match=r"`t` must have dtype bfloat16 or float32, got float16"):
        checks.check_dtype("t", t, (torch.bfloat16, torch.float32), error=TypeError)
    with pytest.raises(ValueError, match=r"`t` must have 4 dimensions \[B, H, L, D\], got shape \[2, 3\]"):
        checks.check_rank("t", t, ("B", "H", "L", "D"))
    with pytest.raises(ValueError, match=r"`t` must have shape \[N, D\] = \[2, 4\], got \[2, 3\]"):
        checks.check_shape("t", t, (2, 4), ("N", "D"))
    checks.check_dtype("t", t, (torch.float16,))
    checks.check_rank("t", t, ("N", "D"))
    checks.check_shape("t", t, (2, 3))


def test_layout_names_dtype_and_shape_together():
    packed = torch.zeros(2, 8, 10, 64, dtype=torch.uint8)
    checks.check_layout("k_packed", packed, torch.uint8, (2, "H_kv", "N", 64))
    expected = r"`k_packed` must be uint8 of shape \[2, H_kv, N, 64\], got float16 \[2, 8, 10, 64\]"
    with pytest.raises(ValueError, match=expected):
        checks.check_layout("k_packed", packed.half(), torch.uint8, (2, "H_kv", "N", 64))
    with pytest.raises(ValueError, match=r"\[2, H_kv, N, 32\], got uint8 \[2, 8, 10, 64\]"):
        checks.check_layout("k_packed", packed, torch.uint8, (2, "H_kv", "N", 32))
    with pytest.raises(ValueError, match=r"got uint8 \[2, 8, 10\]"):
        checks.check_layout("k_packed", packed[..., 0], torch.uint8, (2, "H_kv", "N", 64))
    with pytest.raises(ValueError, match=r"`k_packed` must be uint8 of shape \[2, H_kv, N, 64\], got str"):
        checks.check_layout("k_packed", "x", torch.uint8, (2, "H_kv", "N", 64))


def test_aligned_rows():
    buffer = torch.zeros(2, 12, 64, dtype=torch.uint8)
    checks.check_aligned_rows("k_packed", buffer[:, :10], 16)  # a capacity view: rows stay aligned
    checks.check_aligned_rows("k_packed", torch.zeros(1, 3, 65, dtype=torch.uint8)[:1, :1, :64], 16)  # size-1 dims
    with pytest.raises(ValueError, match=r"`k_packed` needs a contiguous last dimension and 16-byte aligned rows"):
        checks.check_aligned_rows("k_packed", torch.zeros(3, 65, dtype=torch.uint8)[:, :64], 16)
    with pytest.raises(ValueError, match=r"16-byte aligned rows"):
        checks.check_aligned_rows("k_packed", buffer.transpose(1, 2), 16)


def test_shared_dtype_and_device():
    q, k = torch.zeros(1), torch.zeros(1, dtype=torch.float16)
    expected = r"`q`, `k` and `v` must share a dtype, got `q` float32, `k` float16, `v` float32"
    with pytest.raises(TypeError, match=expected):
        checks.check_same_dtype({"q": q, "k": k, "v": q}, error=TypeError)
    with pytest.raises(ValueError, match=r"`q` and `k` must share a device, got `q` cpu, `k` meta"):
        checks.check_same_device({"q": q, "k": torch.zeros(1, device="meta")})
    checks.check_same_dtype({"q": q, "v": q})
    checks.check_same_device({"q": q, "k": k})


def test_check_tensor_runs_the_usual_sequence():
    with pytest.raises(TypeError, match="`x` must be a torch.Tensor"):
        checks.check_tensor("x", 3.0, dtypes=(torch.float32,))
    with pytest.raises(ValueError, match=r"`x` must be a CUDA tensor.*cpu"):
        checks.check_tensor("x", torch.zeros(1), dtypes=(torch.float32,), shape=(1,))
