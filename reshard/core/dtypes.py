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


def cast_array(values: np.ndarray[Any, Any], src: str, dst: str) -> np.ndarray[Any, Any]:
    """Element type `src` -> `dst` of a numpy array of carrier dtype (any shape and strides), rounding to nearest
    even as torch does (bfloat16 included); returns a new array."""
    import numpy as np
    if src == "bfloat16":
        values = (values.astype("<u4") << 16).view("<f4")
    if dst == "bfloat16":
        wide = values.astype("<f4")
        bits = wide.view("<u4")
        rounded: np.ndarray[Any, Any] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        rounded[np.isnan(wide)] = 0x7FC0
        return rounded
    return values.astype(numpy_carrier(dst))
