"""Small helpers shared by the modules: telling NumPy arrays from torch
tensors without importing torch, and handing bfloat16 NumPy arrays to the
extension."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _ext


def is_torch(x: Any) -> bool:
    """Whether x is a torch.Tensor (without importing torch when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def for_ext(x: Any) -> Any:
    """The object to pass to the extension: x itself, except ml_dtypes'
    bfloat16 NumPy arrays, which NumPy cannot export by DLPack and which go
    as a zero-copy bfloat16 view of their bits."""
    if type(x) is np.ndarray and x.dtype.name == "bfloat16":
        return _ext.as_bfloat16(x.view(np.uint16))
    return x
