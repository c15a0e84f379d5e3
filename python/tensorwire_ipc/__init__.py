"""Consumer of tensors a tensorwire producer shares on a local socket (spec/ipc.md).

Pure Python, standard library only: the socket module speaks SOCK_SEQPACKET and receives
file descriptors (SCM_RIGHTS), and mmap maps them. Host tensors come back as writable
memoryviews, or NumPy arrays when NumPy is installed; writes are seen by the producer.

    from tensorwire_ipc import Client
    with Client("/run/tensorwire/share.sock") as client:
        print(client.list())
        with client.open("layer0.weight") as tensor:
            print(tensor.dtype, tensor.shape, tensor.numpy()[:4])

GPU export modes (VMM fds, CUDA IPC handles) are not implemented by the producer yet.
"""

import json
import mmap
import os
import socket

PROTOCOL_VERSION = 1
MAX_MESSAGE = 64 * 1024

# safetensors dtype names -> NumPy type strings (little-endian); BF16 and FP8 have none.
_NUMPY_TYPES = {
    "BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4", "I32": "<i4",
    "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4", "F64": "<f8",
}


class ShareError(Exception):
    """The producer refused a request; `code` is its error code (spec/ipc.md section 2)."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Client:
    """A connection to a producer's sharing socket."""

    def __init__(self, path):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(os.fspath(path))
        self._ask({"op": "hello", "version": PROTOCOL_VERSION})

    def _ask(self, request):
        self._sock.send(json.dumps(request).encode())
        data, fds, flags, _ = socket.recv_fds(self._sock, MAX_MESSAGE + 1, 1)
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the producer closed the connection")
        reply = json.loads(data)
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            error = reply.get("error") or {}
            raise ShareError(error.get("code", "unknown"), error.get("message", ""))
        return reply, fds

    def list(self):
        """Every shared tensor, as dicts (id, name, dtype, shape, byte_len, leases, ...)."""
        return self._ask({"op": "list"})[0]["tensors"]

    def info(self, tensor):
        """One tensor by name or id."""
        return self._ask({"op": "info", "tensor": tensor})[0]["tensor"]

    def open(self, tensor):
        """Maps a tensor under a lease; close the result (or use `with`) to release it."""
        reply, fds = self._ask({"op": "open", "tensor": tensor})
        if len(fds) != 1:
            raise ShareError("bad_reply", "open reply without exactly one descriptor")
        return SharedTensor(self, reply["lease"], reply["descriptor"], fds[0])

    def delete(self, tensor):
        """Deletes a tensor; True if deferred until its leases end."""
        return bool(self._ask({"op": "delete", "tensor": tensor})[0].get("deferred"))

    def close(self):
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SharedTensor:
    """A mapped tensor under a lease."""

    def __init__(self, client, lease, descriptor, fd):
        if descriptor["export"] != "host":
            os.close(fd)
            raise ShareError("unsupported_export", f"export mode {descriptor['export']!r} is not supported here")
        self._client = client
        self.lease = lease
        self.descriptor = descriptor
        self.name = descriptor["name"]
        self.dtype = descriptor["dtype"]
        self.shape = tuple(descriptor["shape"])
        try:
            self._map = mmap.mmap(fd, descriptor["alloc_len"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        start = descriptor["offset"]
        self._view = memoryview(self._map)[start:start + descriptor["byte_len"]]

    def bytes(self):
        """The tensor's bytes, writable in place (the producer sees writes)."""
        return self._view

    def numpy(self):
        """A NumPy array over the same memory (no copy)."""
        import numpy

        kind = _NUMPY_TYPES.get(self.dtype)
        if kind is None:
            return numpy.frombuffer(self._view, dtype="u1")
        return numpy.frombuffer(self._view, dtype=kind).reshape(self.shape)

    def close(self):
        if self._map is None:
            return
        self._view.release()
        self._map.close()
        self._map = None
        self._client._ask({"op": "release", "lease": self.lease})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
