"""Element casts without torch: bit for bit what torch's `Tensor.to` gives (a NaN: a NaN), in cast_into's pieces."""
import numpy as np
import pytest
import torch

from reshard.core.dtypes import CAST_STEP, cast_array, cast_into, numpy_carrier, torch_dtype

FLOATS = ("float32", "bfloat16", "float16", "float64")


def _values() -> torch.Tensor:
    """More than two CAST_STEP pieces of float32: normal values, every bfloat16 rounding case (below, at and past
    halfway, with an even and an odd kept half), subnormals, infinities, signed zeros, values past float16's range."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(2 * CAST_STEP + 1001) * 50).astype("<f4")
    bits = x.view("<u4")
    halves = np.array([0x7FFF, 0x8000, 0x8001], dtype="<u4")
    bits[:6] = np.concatenate([0x3F800000 + halves, 0x3F810000 + halves])     # kept half even (…80), odd (…81)
    bits[6:10] = [0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000]             # subnormals, ±inf
    x[10:13] = [0.0, -0.0, 1e30]
    x[CAST_STEP - 1:CAST_STEP + 2] = [1.00390625, -3.0078125, 65504.0]       # around a piece's edge
    return torch.from_numpy(x)


def _bits(t: torch.Tensor) -> np.ndarray:
    unsigned = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[t.element_size()]
    return t.contiguous().view(unsigned).numpy()


def _carrier(t: torch.Tensor) -> np.ndarray:
    return _bits(t).view(numpy_carrier(str(t.dtype).removeprefix("torch.")))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")    # 1e30 into float16: inf, as torch
@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_matches_torch(src, dst):
    values = _values().to(torch_dtype(src))
    want = values.to(torch_dtype(dst))
    got = cast_array(_carrier(values), src, dst)
    into = cast_into(_carrier(values), src, dst, np.empty(values.numel(), dtype=numpy_carrier(dst)))
    assert got.dtype == numpy_carrier(dst) and into.dtype == got.dtype
    assert np.array_equal(got.view(_bits(want).dtype), _bits(want))
    assert np.array_equal(into.view(_bits(want).dtype), _bits(want))


def test_nan_becomes_torch_nan():
    """Any NaN (payloads, either sign) is bfloat16's NaN; elements past it are untouched."""
    x = np.array([np.nan, -np.nan, 1.0], dtype="<f4")
    x.view("<u4")[0] |= 0x3FFFFF
    got = cast_array(x, "float32", "bfloat16")
    assert torch.from_numpy(got.view(np.int16)).view(torch.bfloat16)[:2].isnan().all()
    assert got[2] == 0x3F80


def test_strided_and_shaped():
    """A strided, 2-D view casts as its contiguous copy would, in its own shape."""
    x = _values()[:4000].reshape(40, 100)[:, ::3]
    got = cast_array(x.numpy(), "float32", "bfloat16")
    assert got.shape == (40, 34)
    assert np.array_equal(got, _bits(x.to(torch.bfloat16)))


def test_comparison_sees_truncation():
    """Negative control: the comparison with torch catches a cast that truncates instead of rounding."""
    x = _values()
    truncated = (x.numpy().view("<u4") >> 16).astype("<u2")
    assert not np.array_equal(truncated, _bits(x.to(torch.bfloat16)))
    assert np.array_equal(cast_array(x.numpy(), "float32", "bfloat16"), _bits(x.to(torch.bfloat16)))


def test_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="3 elements into 2"):
        cast_into(np.zeros(3, dtype="<f4"), "float32", "bfloat16", np.empty(2, dtype="<u2"))
