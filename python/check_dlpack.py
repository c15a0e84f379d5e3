#!/usr/bin/env python3
"""Checks the consumer's DLPack export with ctypes alone (no NumPy or PyTorch needed): the
capsule describes the tensor, its data is the shared bytes, and the lease lasts until the
importer's deleter runs, even after close().

    python3 python/check_dlpack.py SOCKET NAME
"""

import ctypes
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tensorwire_ipc import Client, _dlpack  # noqa: E402


def main(argv):
    path, name = argv[1], argv[2]
    with Client(path) as client:
        assert isinstance(client.devices(), list)
        tensor = client.open(name)
        assert client.info(name)["leases"] == 1
        capsule = tensor.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        managed = _dlpack._Managed.from_address(get(capsule, b"dltensor"))
        dl = managed.dl_tensor
        shape = [dl.shape[i] for i in range(dl.ndim)]
        dtype = (dl.dtype.code, dl.dtype.bits)
        assert shape == list(tensor.shape), (shape, tensor.shape)
        assert dl.device.device_type == _dlpack.KDL_CPU
        data = ctypes.string_at(dl.data, tensor.byte_len)
        assert data == tensor.read(), "the capsule points at the shared bytes"
        tensor.close()
        assert client.info(name)["leases"] == 1, "an imported capsule keeps the lease"
        managed.deleter(ctypes.pointer(managed))  # what an importer does when done; frees it
        assert client.info(name)["leases"] == 0, "the deleter ended the lease"
        try:
            tensor.__cuda_array_interface__
        except AttributeError:
            pass
        else:
            raise AssertionError("a host tensor has no __cuda_array_interface__")
    print("DLPACK-OK", shape, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
