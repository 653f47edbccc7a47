"""How arrays reach the extension: NumPy arrays as they are (nanobind reads
them through the buffer protocol), ml_dtypes' bfloat16 and float8 NumPy
arrays as a typed view of their bits (NumPy cannot export them by DLPack), and torch
tensors as a DLPack capsule made by torch.utils.dlpack.to_dlpack, which
costs about a tenth of the Tensor.__dlpack__ method nanobind would call.
All zero-copy."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _ext

_tensor_type: Any = None
_to_dlpack: Any = None


def _torch_tensor_type() -> Any:
    """torch.Tensor once torch is loaded (kvevict never imports it itself here)."""
    global _tensor_type, _to_dlpack
    if _tensor_type is None and "torch" in sys.modules:
        import torch
        from torch.utils.dlpack import to_dlpack

        _tensor_type, _to_dlpack = torch.Tensor, to_dlpack
    return _tensor_type


def is_torch(x: Any) -> bool:
    """Whether x is a torch.Tensor (without importing torch when it is not loaded)."""
    t = _torch_tensor_type()
    return t is not None and isinstance(x, t)


def for_ext(x: Any) -> Any:
    """The object to pass to the extension for array x (None stays None)."""
    if type(x) is np.ndarray:
        # dtype.kind first: dtype.name builds a string (microseconds a call)
        kind = x.dtype.kind
        if kind == "V" or (kind == "f" and x.dtype.itemsize == 1):  # ml_dtypes: bfloat16 is "V", float8 "f"
            name = x.dtype.name
            if name == "bfloat16":
                return _ext.as_bfloat16(x.view(np.uint16))
            if name in ("float8_e4m3fn", "float8_e5m2"):
                return _ext.as_float8(x.view(np.uint8), name == "float8_e5m2")
        return x
    if x is not None and is_torch(x):
        return _to_dlpack(x.detach() if x.requires_grad else x)
    return x
