"""Consumer of tensors a tensorwire producer shares on a local socket (spec/ipc.md).

Pure Python, standard library only: the socket module speaks SOCK_SEQPACKET and receives
file descriptors (SCM_RIGHTS), mmap maps host tensors, and ctypes over libcuda maps GPU
tensors (a VMM fd or a legacy CUDA IPC handle, plus the tensor's offset). Nothing is copied:
host tensors come back as writable memoryviews or NumPy arrays, GPU tensors go to PyTorch or
CuPy through `__cuda_array_interface__` or DLPack. Writes are seen by the producer.

    from tensorwire_ipc import Client
    with Client("/run/tensorwire/share.sock") as client:
        print(client.list())
        with client.open("layer0.weight") as tensor:
            weights = tensor.torch()          # a torch.Tensor on the producer's GPU, no copy
            weights.mul_(2)                   # the producer sees it
            # or torch.from_dlpack(tensor), cupy.asarray(tensor), tensor.numpy() (host)

Drop the PyTorch/CuPy tensors before closing: closing unmaps the memory and ends the lease
(DLPack imports keep it mapped until the importer frees them).
"""

import json
import mmap
import os
import socket

from . import _cuda, _dlpack
from ._errors import TensorwireError

PROTOCOL_VERSION = 2
MAX_MESSAGE = 64 * 1024

# safetensors dtype names -> NumPy / __cuda_array_interface__ type strings (little-endian);
# BF16 and FP8 have none and are exposed as bytes (use .torch() for BF16).
_NUMPY_TYPES = {
    "BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4", "I32": "<i4",
    "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4", "F64": "<f8",
}


class ShareError(TensorwireError):
    """The producer refused a request, or answered what this consumer cannot use. A
    :class:`TensorwireError` whose `code_name` is the sharing protocol's error code
    (spec/ipc.md section 2, e.g. ``"not_found"``); `code` is None, as it is no wire code."""

    def __init__(self, code_name: str, message: str) -> None:
        super().__init__(f"{code_name}: {message}", code_name=code_name)
        self.message = message


class _Connection:
    """Owns a socket to the producer; closes it on close() or at the end of `with`."""

    def close(self):
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client(_Connection):
    """A connection to a producer's sharing socket."""

    def __init__(self, path):
        self._path = os.fspath(path)
        self._sock = _hello(self._path)

    def _ask(self, request):
        return _ask(self._sock, request)

    def list(self):
        """Every shared tensor, as dicts (id, name, dtype, shape, byte_len, leases, ...)."""
        return self._ask({"op": "list"})[0]["tensors"]

    def info(self, tensor):
        """One tensor by name or id."""
        return self._ask({"op": "info", "tensor": tensor})[0]["tensor"]

    def open(self, tensor, all_gpus=False, wait=None):
        """Maps a tensor under a lease; close the result (or use `with`) to release it.
        With `all_gpus`, VMM memory is also made accessible to every other GPU here. With
        `wait` (seconds), a name not published yet is waited for that long."""
        request = {"op": "open", "tensor": tensor}
        if wait is not None:
            request["wait_ms"] = max(0, int(wait * 1000))
        reply, fds = self._ask(request)
        if len(fds) > 1:
            for fd in fds:
                os.close(fd)
            raise ShareError("bad_reply", "open reply with more than one descriptor")
        return SharedTensor(self, reply["lease"], reply["descriptor"], fds[0] if fds else None, all_gpus)

    def watch(self, prefix=""):
        """Events for tensors whose names start with `prefix`, from now on: an iterator of
        dicts {"event": "published" | "updated" | "deleted", "tensor": {... "generation" ...}},
        on a connection of its own (close it, or use `with`)."""
        return Watch(self._path, prefix)

    def devices(self):
        """The producer's GPUs: ordinal (in the producer), name, uuid, memory, compute capability."""
        return self._ask({"op": "devices"})[0].get("devices", [])

    def delete(self, tensor):
        """Deletes a tensor; True if deferred until its leases end."""
        return bool(self._ask({"op": "delete", "tensor": tensor})[0].get("deferred"))



def _hello(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        _ask(sock, {"op": "hello", "version": PROTOCOL_VERSION})
    except BaseException:
        sock.close()
        raise
    return sock


def _ask(sock, request):
    sock.send(json.dumps(request).encode())
    return _receive(sock)


def _receive(sock):
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE + 1, 1)
    if not data:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the producer closed the connection")
    reply = json.loads(data)
    if "event" in reply:
        return reply, fds
    if not reply.get("ok"):
        for fd in fds:
            os.close(fd)
        error = reply.get("error") or {}
        raise ShareError(error.get("code", "unknown"), error.get("message", ""))
    return reply, fds


class Watch(_Connection):
    """An iterator of events from `Client.watch`; `next(timeout)` waits at most `timeout`
    seconds and returns None if nothing happened."""

    def __init__(self, path, prefix):
        self._sock = _hello(path)
        try:
            _ask(self._sock, {"op": "watch", "prefix": prefix})
        except BaseException:
            self._sock.close()
            raise

    def next(self, timeout=None):
        self._sock.settimeout(timeout)
        try:
            event, fds = _receive(self._sock)
        except socket.timeout:
            return None
        for fd in fds:
            os.close(fd)
        return event

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return self.next()
        except ConnectionError:
            raise StopIteration from None



class SharedTensor:
    """A mapped tensor under a lease: host memory (`export == "host"`) or GPU memory."""

    def __init__(self, client, lease, descriptor, fd, all_gpus=False):
        self._client = client
        self.lease = lease
        self.descriptor = descriptor
        self.name = descriptor["name"]
        self.dtype = descriptor["dtype"]
        self.shape = tuple(descriptor["shape"])
        self.export = descriptor["export"]
        self.byte_len = descriptor["byte_len"]
        self.numel = descriptor.get("numel")
        self.element_size = descriptor.get("element_size")
        # The sender's attributes (a WAV's sample_rate...), the generation (1, then one more
        # per update of the name), when it landed, and the producer's device (None on host).
        self.attributes = dict(descriptor.get("attributes") or {})
        self.generation = descriptor.get("generation")
        self.landed_unix_us = descriptor.get("landed_unix_us")
        self.device_info = descriptor.get("device")
        self._map = self._view = None
        self._release_gpu = None
        self._dlpack_live = 0
        self._closing = False
        start, alloc_len = descriptor["offset"], descriptor["alloc_len"]
        if start + self.byte_len > alloc_len:
            self._close_fd(fd)
            self._give_back()
            raise ShareError("bad_reply", "the tensor lies past the end of the shared memory")
        try:
            if self.export == "host":
                self._map = mmap.mmap(fd, alloc_len, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._view = memoryview(self._map)[start:start + self.byte_len]
                self.device = None
            elif self.export in ("vmm", "cuda_ipc"):
                cuda = _cuda.driver()
                self.device = cuda.device_by_uuid(descriptor["device_uuid"])
                if self.export == "vmm":
                    if fd is None:
                        raise ShareError("bad_reply", "vmm reply without an fd")
                    peers = range(cuda.device_count()) if all_gpus else ()
                    base, self._release_gpu = cuda.import_vmm(fd, alloc_len, self.device, peers)
                else:
                    handle = bytes.fromhex(descriptor.get("handle") or "")
                    if len(handle) != 64:
                        raise ShareError("bad_reply", "cuda_ipc descriptor without a 64-byte handle")
                    base, self._release_gpu = cuda.open_ipc(handle, self.device)
                # A handle names the whole allocation: the offset is what finds this tensor.
                self.device_ptr = base + start
            else:
                raise ShareError("unsupported_export", f"export mode {self.export!r} is not supported here")
        except BaseException:
            self._give_back()
            raise
        finally:
            self._close_fd(fd)

    @staticmethod
    def _close_fd(fd):
        if fd is not None:
            os.close(fd)

    @property
    def is_gpu(self):
        return self.export != "host"

    def bytes(self):
        """A host tensor's bytes, writable in place (the producer sees writes)."""
        if self.is_gpu:
            raise ShareError("wrong_memory", "a GPU tensor has no host bytes: use read(), torch() or cupy()")
        return self._view

    def read(self):
        """A copy of the tensor's bytes in host memory (from the GPU for a GPU tensor)."""
        if self.is_gpu:
            return _cuda.driver().read(self.device_ptr, self.byte_len, self.device)
        return bytes(self._view)

    def write(self, data):
        """Overwrites the tensor in place with `data` (exactly its length)."""
        if len(data) != self.byte_len:
            raise ValueError(f"{len(data)} bytes for a {self.byte_len}-byte tensor")
        if self.is_gpu:
            _cuda.driver().write(self.device_ptr, bytes(data), self.device)
        else:
            self._view[:] = data

    def numpy(self):
        """A NumPy array over the same host memory (no copy)."""
        import numpy

        kind = _NUMPY_TYPES.get(self.dtype)
        if kind is None:
            return numpy.frombuffer(self.bytes(), dtype="u1")
        return numpy.frombuffer(self.bytes(), dtype=kind).reshape(self.shape)

    @property
    def __cuda_array_interface__(self):
        """The CUDA Array Interface (v3) of a GPU tensor: CuPy, Numba and PyTorch read it.
        BF16 and FP8 appear as bytes (shape `(byte_len,)`)."""
        if not self.is_gpu:
            raise AttributeError("a host tensor has no __cuda_array_interface__")
        kind = _NUMPY_TYPES.get(self.dtype)
        shape, typestr = (self.shape, kind) if kind else ((self.byte_len,), "|u1")
        # stream None: the producer published the tensor after its last copy completed.
        return {"shape": shape, "typestr": typestr, "data": (self.device_ptr, False),
                "version": 3, "strides": None, "stream": None}

    def __dlpack_device__(self):
        return (_dlpack.KDL_CUDA, self.device) if self.is_gpu else (_dlpack.KDL_CPU, 0)

    def __dlpack__(self, stream=None, **_):
        """A DLPack capsule over the same memory; the mapping stays until the importer
        frees its tensor, even if this object is closed first."""
        if self._closing:
            raise ShareError("closed", "the tensor is closed")
        if self.is_gpu:
            ptr, device = self.device_ptr, (_dlpack.KDL_CUDA, self.device)
        else:
            ptr, device = _address_of(self._view), (_dlpack.KDL_CPU, 0)
        capsule = _dlpack.capsule(ptr, device[0], device[1], self.dtype, list(self.shape), self._dlpack_ended)
        self._dlpack_live += 1
        return capsule

    def _dlpack_ended(self):
        self._dlpack_live -= 1
        if self._closing and self._dlpack_live == 0:
            self._unmap()

    def torch(self):
        """A torch.Tensor over the same memory (no copy), with the tensor's dtype and shape."""
        import torch

        return torch.from_dlpack(self)

    def cupy(self):
        """A cupy.ndarray over the same GPU memory (no copy)."""
        import cupy

        return cupy.asarray(self)

    def close(self):
        """Unmaps (once no DLPack import holds it) and ends the lease."""
        if self._closing:
            return
        self._closing = True
        if self._dlpack_live == 0:
            self._unmap()

    def _unmap(self):
        if self._view is not None:
            self._view.release()
            self._map.close()
            self._view = self._map = None
        if self._release_gpu is not None:
            self._release_gpu()
            self._release_gpu = None
        self._give_back()

    def _give_back(self):
        if self.lease is not None:
            lease, self.lease = self.lease, None
            self._client._ask({"op": "release", "lease": lease})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _address_of(view):
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))
