"""Element types by name, so metadata can be handled without importing torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# torch.<Name>Storage class -> element type name (torch.dtype name without "torch.")
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}

_ITEMSIZE = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}

# Short names people type (ds_config, CLI) -> dtype names.
SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "float32": "float32",
         "float16": "float16", "bfloat16": "bfloat16"}


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


def is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def torch_dtype(dtype: str) -> Any:
    import torch
    return getattr(torch, dtype)


def numpy_carrier(dtype: str) -> np.dtype[Any]:
    """A numpy dtype with the same item size, for moving the raw bytes (numpy has no bfloat16)."""
    import numpy as np
    if dtype == "bfloat16":
        return np.dtype("<u2")
    if dtype == "bool":
        return np.dtype("u1")
    return np.dtype(dtype).newbyteorder("<")


# Elements cast at a time: a piece's temporaries (4 bytes an element) stay in the core's cache, where casting a whole
# 16 MiB block through numpy's temporaries made and faulted in six fresh arrays of its size (0.7 CPU-s per GB cast,
# against 0.2 in pieces)
CAST_STEP = 1 << 17
_NAN_BFLOAT16 = 0x7FC0      # any NaN cast to bfloat16: its quiet NaN (a NaN to torch too)


def cast_array(values: np.ndarray[Any, Any], src: str, dst: str) -> np.ndarray[Any, Any]:
    """Element type `src` -> `dst` of a numpy array of carrier dtype (any shape and strides), rounding to nearest
    even as torch does (bfloat16 included); returns a new array."""
    import numpy as np
    out = np.empty(values.shape, dtype=numpy_carrier(dst))
    cast_into(np.ascontiguousarray(values).reshape(-1), src, dst, out.reshape(-1))
    return out


def cast_into(values: np.ndarray[Any, Any], src: str, dst: str, out: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """`values` (1-D, contiguous, carrier dtype of `src`) cast into `out` (1-D, contiguous, carrier dtype of `dst`,
    as long), CAST_STEP elements at a time through one scratch piece, as cast_array rounds; returns `out`."""
    import numpy as np
    if values.size != out.size:
        raise ValueError(f"cast of {values.size} elements into {out.size}")
    step = min(CAST_STEP, values.size)
    wide = np.empty(0 if "float32" in (src, dst) else step, dtype="<f4")    # bfloat16 to or from another float
    scratch = np.empty(step if dst == "bfloat16" != src else 0, dtype="<u4")
    for lo in range(0, values.size, CAST_STEP):
        part, into = values[lo:lo + CAST_STEP], out[lo:lo + CAST_STEP]
        if src == dst:
            into[...] = part
            continue
        if src == "bfloat16":       # its bits are a float32's top half
            up = into.view("<u4") if dst == "float32" else wide[:part.size]
            np.left_shift(part, 16, out=up.view("<u4"), dtype=np.uint32)
            if dst != "float32":
                np.copyto(into, up, casting="unsafe")
        elif dst == "bfloat16":
            if src != "float32":
                np.copyto(wide[:part.size], part, casting="unsafe")
                part = wide[:part.size]
            _round_to_bfloat16(part, into, scratch[:part.size])
        else:
            np.copyto(into, part, casting="unsafe")
    return out


def _round_to_bfloat16(values: np.ndarray[Any, Any], out: np.ndarray[Any, Any], scratch: np.ndarray[Any, Any]
                       ) -> None:
    """float32 `values` to bfloat16 bits in `out`: the top half of each, rounded to nearest even (the lower half plus
    0x7FFF, plus the kept half's lowest bit, carries into it past the halfway point); any NaN _NAN_BFLOAT16."""
    import numpy as np
    bits = values.view("<u4")
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.right_shift(scratch, 16, out=out, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = _NAN_BFLOAT16
