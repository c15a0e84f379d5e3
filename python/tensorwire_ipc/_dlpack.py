"""DLPack export through ctypes: `__dlpack__` capsules that PyTorch, CuPy and JAX import
with no copy. The capsule owns a reference to the shared tensor until the importer's
tensor is freed (the DLPack deleter), so the mapping and the lease outlive it."""

import ctypes

KDL_CPU = 1
KDL_CUDA = 2

# safetensors dtype -> (DLPack type code, bits); FP8 travels as uint8 with its shape (one
# byte per element), since importers disagree on FP8 codes: as the Rust export does.
_TYPES = {
    "BOOL": (6, 8), "U8": (1, 8), "I8": (0, 8), "U16": (1, 16), "I16": (0, 16),
    "U32": (1, 32), "I32": (0, 32), "U64": (1, 64), "I64": (0, 64),
    "F16": (2, 16), "BF16": (4, 16), "F32": (2, 32), "F64": (2, 64),
    "F8_E4M3": (1, 8), "F8_E5M2": (1, 8),
}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int),
        ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

# Exports alive in an importer, by the address of their managed tensor.
_alive: dict = {}


@_Deleter
def _delete(managed):
    entry = _alive.pop(ctypes.addressof(managed.contents), None)
    if entry is not None:
        entry[-1]()  # tell the owner one export ended


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule(ptr, device_type, device_id, dtype, shape, on_release):
    """A "dltensor" capsule over `ptr`; `on_release()` runs when the importer frees it.

    A capsule that is never imported is never released: import what you export."""
    if dtype not in _TYPES:
        raise ValueError(f"no DLPack type for dtype {dtype!r}")
    code, bits = _TYPES[dtype]
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = _Managed()
    managed.dl_tensor = _Tensor(ptr, _Device(device_type, device_id), len(shape),
                                _DataType(code, bits, 1), dims, None, 0)
    managed.deleter = _delete
    _alive[ctypes.addressof(managed)] = (managed, dims, on_release)
    return _new_capsule(ctypes.addressof(managed), b"dltensor", None)

