"""A DLPack producer that claims CUDA memory: lets the tests check, without
a GPU, that kvevict refuses a device mismatch and that the CUDA path's
argument checks run on the host before anything is launched."""

from __future__ import annotations

import ctypes

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CODES = {"float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16), "int32": (0, 32), "int64": (0, 64),
          "uint8": (1, 8), "uint64": (1, 64)}


class FakeCudaArray:
    """An array that DLPack reports on cuda:0. Its data pointer is not valid
    memory: kvevict must refuse it, or stop at its host-side checks, before
    reading anything."""

    _next = 0

    def __init__(self, shape, dtype="float32"):
        self.shape = tuple(shape)
        n = len(shape)
        self._shape = (ctypes.c_int64 * n)(*shape)
        strides = [1] * n
        for d in range(n - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        self._strides = (ctypes.c_int64 * n)(*strides)
        self._tensor = _DLManagedTensor()
        t = self._tensor.dl_tensor
        FakeCudaArray._next += 1 << 32  # distinct, far-apart addresses: no two fake arrays overlap
        t.data, t.device, t.ndim = FakeCudaArray._next, _DLDevice(2, 0), n
        code, bits = _CODES[dtype]
        t.dtype = _DLDataType(code, bits, 1)
        t.shape, t.strides = self._shape, self._strides

    def __dlpack__(self, *args, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._tensor), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, 0)


