"""The few CUDA driver calls a consumer needs, through ctypes over libcuda (no compiled code).

Maps GPU memory a producer shares (spec/ipc.md section 3): a VMM allocation exported as a
POSIX fd (`vmm`), or a legacy CUDA IPC handle (`cuda_ipc`), always plus the tensor's offset.
"""

import ctypes
import threading

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1

_u64 = ctypes.c_ulonglong
_size = ctypes.c_size_t


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_driver = None
_driver_lock = threading.Lock()


def driver():
    """The process's libcuda, initialised once; raises CudaError if there is none."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


class _Driver:
    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"no CUDA driver (libcuda.so.1): {e}") from None
        self._lib = lib
        p = ctypes.POINTER
        self._sig("cuInit", [ctypes.c_uint])
        self._sig("cuGetErrorName", [ctypes.c_int, p(ctypes.c_char_p)])
        self._sig("cuDeviceGetCount", [p(ctypes.c_int)])
        self._sig("cuDeviceGet", [p(ctypes.c_int), ctypes.c_int])
        uuid_call = "cuDeviceGetUuid_v2" if hasattr(lib, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
        self._uuid = self._sig(uuid_call, [ctypes.c_char_p, ctypes.c_int])
        self._sig("cuDevicePrimaryCtxRetain", [p(ctypes.c_void_p), ctypes.c_int])
        self._sig("cuCtxSetCurrent", [ctypes.c_void_p])
        self._sig("cuMemImportFromShareableHandle", [p(_u64), ctypes.c_void_p, ctypes.c_int])
        self._sig("cuMemAddressReserve", [p(_u64), _size, _size, _u64, _u64])
        self._sig("cuMemMap", [_u64, _size, _size, _u64, _u64])
        self._sig("cuMemSetAccess", [_u64, _size, p(_MemAccessDesc), _size])
        self._sig("cuMemUnmap", [_u64, _size])
        self._sig("cuMemAddressFree", [_u64, _size])
        self._sig("cuMemRelease", [_u64])
        self._ipc_open = self._sig("cuIpcOpenMemHandle_v2", [p(_u64), _IpcMemHandle, ctypes.c_uint])
        self._sig("cuIpcCloseMemHandle", [_u64])
        self._sig("cuMemcpyDtoH_v2", [ctypes.c_void_p, _u64, _size])
        self._sig("cuMemcpyHtoD_v2", [_u64, ctypes.c_void_p, _size])
        self.check(lib.cuInit(0), "cuInit")
        self._contexts = {}
        self._opened = {}  # legacy handle bytes -> [pointer, users]
        self._lock = threading.Lock()

    def _sig(self, name, argtypes):
        fn = getattr(self._lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn

    def check(self, result, call):
        if result != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaError(f"{call} failed: {(name.value or b'?').decode()} ({result})")

    def device_count(self):
        count = ctypes.c_int()
        self.check(self._lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return count.value

    def device_by_uuid(self, uuid):
        """The ordinal in this process of the GPU with this UUID (ordinals differ per process)."""
        wanted = uuid.lower().removeprefix("gpu-").replace("-", "")
        for ordinal in range(self.device_count()):
            device = ctypes.c_int()
            self.check(self._lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
            raw = ctypes.create_string_buffer(16)
            self.check(self._uuid(raw, device), "cuDeviceGetUuid")
            if raw.raw.hex() == wanted:
                return ordinal
        raise CudaError(f"no GPU with UUID {uuid} here (hidden by CUDA_VISIBLE_DEVICES?)")

    def bind(self, ordinal):
        """Makes the device's primary context (the one PyTorch and CuPy use) current."""
        ctx = self._contexts.get(ordinal)
        if ctx is None:
            ctx = ctypes.c_void_p()
            self.check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain")
            self._contexts[ordinal] = ctx
        self.check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def import_vmm(self, fd, size, ordinal, peers=()):
        """Maps a VMM fd of `size` bytes; returns (pointer, release function)."""
        lib = self._lib
        self.bind(ordinal)
        handle = _u64()
        self.check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   "cuMemImportFromShareableHandle")
        ptr = _u64()
        steps = [lambda: lib.cuMemRelease(handle)]

        def release():
            for step in reversed(steps):
                step()

        try:
            self.check(lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
            steps.append(lambda: lib.cuMemAddressFree(ptr, size))
            self.check(lib.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
            steps.append(lambda: lib.cuMemUnmap(ptr, size))
            devices = [ordinal] + [p for p in peers if p != ordinal]
            descs = (_MemAccessDesc * len(devices))(*[
                _MemAccessDesc(_MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, d), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                for d in devices])
            self.check(lib.cuMemSetAccess(ptr, size, descs, len(devices)), "cuMemSetAccess")
        except BaseException:
            release()
            raise
        return ptr.value, release

    def open_ipc(self, handle, ordinal):
        """Opens a legacy IPC handle (64 bytes); returns (pointer of the whole allocation, release)."""
        with self._lock:
            self.bind(ordinal)
            entry = self._opened.get(handle)
            if entry is None:
                ptr = _u64()
                self.check(self._ipc_open(ctypes.byref(ptr), _IpcMemHandle.from_buffer_copy(handle),
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
                entry = self._opened[handle] = [ptr.value, 0]
            entry[1] += 1

        def release():
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._opened[handle]
                    self.bind(ordinal)
                    self._lib.cuIpcCloseMemHandle(entry[0])

        return entry[0], release

    def read(self, ptr, size, ordinal):
        """`size` bytes at device address `ptr`, copied to host."""
        self.bind(ordinal)
        out = ctypes.create_string_buffer(size)
        self.check(self._lib.cuMemcpyDtoH_v2(out, ptr, size), "cuMemcpyDtoH")
        return out.raw

    def write(self, ptr, data, ordinal):
        """Copies `data` to device address `ptr`."""
        self.bind(ordinal)
        self.check(self._lib.cuMemcpyHtoD_v2(ptr, data, len(data)), "cuMemcpyHtoD")
