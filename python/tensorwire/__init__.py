"""tensorwire: send tensors over QUIC straight into GPU memory, receive them with no copy into
PyTorch, CuPy or NumPy.

    import numpy as np, tensorwire
    rx = tensorwire.Receiver("127.0.0.1:0")               # lands on GPU 0 if there is one
    tensorwire.send(rx.address, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    t = rx.recv()
    w = torch.from_dlpack(t)   # on the GPU, no copy; or t.numpy() for host tensors

``send`` takes anything with ``__dlpack__`` or ``__cuda_array_interface__`` or the buffer
protocol (PyTorch, CuPy, NumPy, bytes), on the host or a GPU, or a ``.safetensors`` path.
Every failure raises :class:`TensorwireError` with the wire code. The pure-Python consumer of
shared tensors, ``tensorwire_ipc``, ships in the same package.
"""

import asyncio
import json
import os
import struct
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _native

if TYPE_CHECKING:
    import numpy as np
from .errors import ReceiveTimeout, ReceiverClosed, ShareError, TensorwireError

__all__ = [
    "GpuStatus",
    "ShareService",
    "SharedBuffer",
    "empty",
    "Raw",
    "ReceiveTimeout",
    "ReceivedTensor",
    "Receiver",
    "ReceiverClosed",
    "SendResult",
    "SendProgress",
    "SendWaits",
    "Sender",
    "TensorwireError",
    "ShareError",
    "devices",
    "pinned_datagram_stats",
    "send",
    "send_async",
]

__version__ = _native.VERSION

# Attributes the Rust sender sets, so a receiver rebuilds files sent from .safetensors.
_FILE_ATTR = "tensorwire.file"
_FILE_TENSORS_ATTR = "tensorwire.file_tensors"
_FILE_METADATA_ATTR = "safetensors.metadata"
_SENDER_ATTR = "tensorwire.sender"

_NUMPY_TO_DTYPE = {
    "|b1": "BOOL",
    "|u1": "U8",
    "|i1": "I8",
    "<u2": "U16",
    "<i2": "I16",
    "<u4": "U32",
    "<i4": "I32",
    "<u8": "U64",
    "<i8": "I64",
    "<f2": "F16",
    "<f4": "F32",
    "<f8": "F64",
}
# ml_dtypes' names, for NumPy arrays of types NumPy itself lacks.
_NAMED_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_DTYPE_TO_NUMPY = {v: k for k, v in _NUMPY_TO_DTYPE.items()}
# Element sizes, for raw buffers (spec §5.1).
_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}


@dataclass(frozen=True)
class Raw:
    """Bytes with an explicit dtype and shape: for types NumPy lacks (BF16, FP8) without
    ml_dtypes, or any buffer sent as is."""

    dtype: str
    shape: Sequence[int]
    data: Any


@dataclass(frozen=True)
class SendWaits:
    """Seconds one send waited for each thing it needs: which side held it up. A tensor sent
    as parts over several connections sums its parts' waits, which run at once."""

    #: For the receiver: a stream it allows, its ACCEPT, CREDIT once the bytes granted were
    #: sent, and COMPLETE once every byte was. A slow or full receiver shows here.
    receiver: float = 0.0
    #: For the source's next checksummed chunk (a file's pages from disk, a GPU tensor's
    #: copies to the host).
    source: float = 0.0
    #: For QUIC to take the bytes: congestion control or a slow path.
    transport: float = 0.0
    #: For the large tensors before it on its connection to hand over their bytes.
    turn: float = 0.0

    def __str__(self) -> str:
        return (
            f"receiver {self.receiver:.2f} s, source {self.source:.2f} s, "
            f"QUIC {self.transport:.2f} s, turn {self.turn:.2f} s"
        )


@dataclass(frozen=True)
class SendResult:
    """One tensor sent and acknowledged (COMPLETE: resident where the receiver put it)."""

    name: str
    nbytes: int
    seconds: float
    #: What the send waited for, and how long.
    waited: SendWaits = SendWaits()
    #: What the receiver made of the tensor (spec §6.8): ``tensorwire.device`` where it
    #: landed, ``tensorwire.shared.id`` and ``tensorwire.shared.generation`` when it shares
    #: it with local processes. Empty from a receiver older than protocol 1.5.
    receipt: Dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> Optional[str]:
        """Where the tensor landed: ``"cuda:0"``, ``"host"``, or None if not said."""
        return self.receipt.get("tensorwire.device")

    @property
    def shared_id(self) -> Optional[str]:
        """The id local processes open the tensor by, when the receiver shares it."""
        return self.receipt.get("tensorwire.shared.id")

    @property
    def shared_generation(self) -> Optional[int]:
        """The shared tensor's generation (1 when first shared), when the receiver shares it."""
        value = self.receipt.get("tensorwire.shared.generation")
        return int(value) if value is not None and value.isdigit() else None


@dataclass(frozen=True)
class SendProgress:
    """How far a :func:`send` is, given to its `progress` callback about ten times a second
    and once at the end."""

    #: Payload bytes handed to the network so far, and in all, of the tensors started.
    sent_bytes: int
    total_bytes: int
    #: Each started tensor's ``(sent_bytes, total_bytes)``, by name.
    tensors: Dict[str, Tuple[int, int]]

    @property
    def tensors_done(self) -> int:
        """Tensors whose every byte was handed over (acknowledgement may still be due)."""
        return sum(1 for sent, total in self.tensors.values() if sent >= total)


def _print_progress(progress: "SendProgress") -> None:
    """`progress=True`: one line on the terminal, rewritten as the send goes."""
    if sys.stderr.isatty():
        line = (
            f"sent {progress.sent_bytes / (1 << 20):.1f} of {progress.total_bytes / (1 << 20):.1f} MiB, "
            f"{progress.tensors_done} of {len(progress.tensors)} tensors"
        )
        print(f"\r{line}", end="", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GpuStatus:
    """Whether this process can use a GPU, and why not."""

    available: bool
    device_count: int
    description: str

    @staticmethod
    def detect() -> "GpuStatus":
        """Probes the CUDA driver (libcuda is loaded at run time; no toolkit needed)."""
        return GpuStatus(*_native.gpu_status())


def devices() -> List[Dict[str, Any]]:
    """Each GPU: ordinal, name, uuid, compute_capability, total_memory."""
    return _native.devices()


def pinned_datagram_stats() -> Dict[str, int]:
    """How the pinned region received datagrams land in has been used: `capacity` (bytes;
    0 until a GPU `Receiver` pinned it), slots `lent` now, allocations `served` from it, and
    allocations that found it full (`overflowed`; their payloads go through staging), and
    how far into it a slot was ever lent (`reached`, bytes: about the most received bytes
    that waited for their copy at once)."""
    capacity, lent, served, overflowed, reached = _native.pinned_datagram_stats()
    return {
        "capacity": capacity,
        "lent": lent,
        "served": served,
        "overflowed": overflowed,
        "reached": reached,
    }


def _torch_dtype(t: Any) -> str:
    import torch

    table = {
        torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
        torch.int32: "I32", torch.int64: "I64", torch.float16: "F16",
        torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
    }
    for name, code in [("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                       ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")]:
        if hasattr(torch, name):
            table[getattr(torch, name)] = code
    if t.dtype not in table:
        raise TypeError(f"torch dtype {t.dtype} has no tensorwire dtype")
    return table[t.dtype]


def _host(array: Any) -> Tuple[int, int, Any]:
    """`(address, bytes, owner)` of a C-contiguous NumPy array, without copying; the owner
    keeps the memory alive while it is sent (do not modify it meanwhile)."""
    import numpy as np

    array = _contiguous(np.asarray(array))
    return (array.__array_interface__["data"][0], array.nbytes, array)


def _contiguous(array: Any) -> Any:
    """`array` in C order, copied only if it is not (np.ascontiguousarray would also turn a
    0-d array into a 1-d one)."""
    import numpy as np

    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _item(name: str, obj: Any) -> Tuple[str, str, List[int], str, Any, List[Tuple[str, str]]]:
    """`(name, dtype, shape, kind, payload, attributes)` for the native sender."""
    import numpy as np

    if isinstance(obj, Raw):
        data = np.frombuffer(obj.data, dtype=np.uint8)
        return (name, obj.dtype.upper(), list(obj.shape), "host", _host(data), [])
    if isinstance(obj, (bytes, bytearray, memoryview)):
        data = np.frombuffer(obj, dtype=np.uint8)
        return (name, "U8", [data.nbytes], "host", _host(data), [])
    module = type(obj).__module__.split(".")[0]
    if module == "torch":
        t = obj.detach().contiguous()
        dtype = _torch_dtype(t)
        shape = list(t.shape)
        if t.is_cuda:
            import torch

            # Bytes queued on the tensor's stream are written before they are read.
            torch.cuda.current_stream(t.device).synchronize()
            return (name, dtype, shape, "device", (t.data_ptr(), t.nbytes, t.device.index, t), [])
        # NumPy has no BF16 or FP8: their bits go as integers of the same width.
        raw = t.view(torch.int16) if dtype == "BF16" else t.view(torch.uint8) if dtype.startswith("F8") else t
        return (name, dtype, shape, "host", _host(raw.numpy()), [])
    cuda = getattr(obj, "__cuda_array_interface__", None)
    if cuda is not None:
        return _cuda_array_item(name, obj, cuda)
    if hasattr(obj, "__dlpack_device__") and not isinstance(obj, np.ndarray):
        # Any other DLPack producer (JAX, a tensor received here): through NumPy on the
        # host, through PyTorch or CuPy on a GPU, without a copy either way.
        kind, _ = obj.__dlpack_device__()
        if kind == 1:
            return _item(name, np.from_dlpack(obj))
        for framework in ("torch", "cupy"):
            try:
                reader = __import__(framework)
            except ImportError:
                continue
            return _item(name, reader.from_dlpack(obj))
        raise TypeError(f"{name}: a GPU DLPack tensor needs PyTorch or CuPy to be read")
    array = _contiguous(np.asarray(obj))
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    named = _NAMED_DTYPES.get(array.dtype.name) or _NUMPY_TO_DTYPE.get(array.dtype.str)
    if named is None:
        raise TypeError(
            f"{name}: NumPy dtype {array.dtype} has no tensorwire dtype; use tensorwire.Raw"
        )
    return (name, named, list(array.shape), "host", _host(array), [])


def _cuda_array_item(name: str, obj: Any, cuda: Mapping[str, Any]):
    """An object with ``__cuda_array_interface__`` (CuPy, Numba): read from device memory."""
    import numpy as np

    if cuda.get("strides") not in (None, ()):
        # Strides given: require C order.
        itemsize = np.dtype(cuda["typestr"]).itemsize
        expected: List[int] = []
        acc = itemsize
        for dim in reversed(cuda["shape"]):
            expected.insert(0, acc)
            acc *= dim
        if list(cuda["strides"]) != expected:
            raise ValueError(f"{name}: only C-contiguous device arrays are sent")
    typestr = np.dtype(cuda["typestr"]).str
    dtype = _NUMPY_TO_DTYPE.get(typestr)
    if dtype is None:
        raise TypeError(f"{name}: device dtype {typestr} has no tensorwire dtype")
    stream = cuda.get("stream")
    if stream not in (None, 0, 1, 2):
        import ctypes

        libcuda = ctypes.CDLL("libcuda.so.1")
        libcuda.cuStreamSynchronize(ctypes.c_void_p(stream))
    shape = list(cuda["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(typestr).itemsize if shape else np.dtype(typestr).itemsize
    device = getattr(getattr(obj, "device", None), "id", 0)
    return (name, dtype, shape, "device", (int(cuda["data"][0]), nbytes, int(device), obj), [])


def _npy_items(path: Union[str, os.PathLike]) -> List[Tuple]:
    """The array of a .npy file, mapped (not read into memory), named after the file."""
    import numpy as np

    path = os.fspath(path)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise TensorwireError(f"{path}: not a NumPy array file: {e}") from None
    name = os.path.splitext(os.path.basename(path))[0]
    return [_item(name, array)]


def _wav_items(path: str) -> List[Tuple]:
    """A .wav file's samples as F32 in [-1, 1), shape [frames] (mono) or [frames, channels],
    with ``sample_rate`` and ``channels`` attributes: what ``sender`` makes of it. PCM of 8
    to 32 bits and IEEE float of 32 or 64 bits."""
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise TensorwireError(f"{path}: not a .wav file (no RIFF/WAVE header)")
    fmt, samples, at = None, None, 12
    while at + 8 <= len(data):
        chunk, size = data[at : at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = data[at + 8 : at + 8 + size]
        if len(body) < size:
            raise TensorwireError(f"{path}: the {chunk!r} chunk ends early")
        if chunk == b"fmt " and size >= 16:
            fmt = struct.unpack_from("<HHIIHH", body)
            if fmt[0] == 0xFFFE and size >= 26:  # WAVE_FORMAT_EXTENSIBLE: the subformat's tag
                fmt = (struct.unpack_from("<H", body, 24)[0],) + fmt[1:]
        elif chunk == b"data":
            samples = body
        at += 8 + size + (size & 1)
    if fmt is None or samples is None:
        raise TensorwireError(f"{path}: a .wav file needs a 'fmt ' and a 'data' chunk")
    tag, channels, rate, _, block, bits = fmt
    kinds = {(1, 8): "u1", (1, 16): "<i2", (1, 32): "<i4", (3, 32): "<f4", (3, 64): "<f8"}
    if channels == 0 or block != channels * ((bits + 7) // 8):
        raise TensorwireError(f"{path}: {channels} channels in blocks of {block} bytes do not add up")
    if (tag, bits) == (1, 24):
        raw = np.frombuffer(samples[: len(samples) - len(samples) % 3], dtype=np.uint8).reshape(-1, 3)
        ints = (raw[:, 0].astype(np.int32) | raw[:, 1].astype(np.int32) << 8 | raw[:, 2].astype(np.int32) << 16)
        values = ((ints << 8) >> 8).astype(np.float32) / float(1 << 23)
    elif (tag, bits) in kinds:
        kind = np.dtype(kinds[(tag, bits)])
        raw = np.frombuffer(samples[: len(samples) - len(samples) % kind.itemsize], dtype=kind)
        if tag == 3:
            values = raw.astype(np.float32)
        elif bits == 8:  # unsigned, centred on 128
            values = (raw.astype(np.float32) - 128.0) / 128.0
        else:
            values = raw.astype(np.float32) / float(1 << (bits - 1))
    else:
        raise TensorwireError(f"{path}: WAV format {tag} with {bits}-bit samples is not supported (PCM 8-32, float 32/64)")
    frames = len(values) // channels
    values = np.ascontiguousarray(values[: frames * channels])
    shaped = values if channels == 1 else values.reshape(frames, channels)
    name = os.path.splitext(os.path.basename(path))[0]
    item = _item(name, shaped)
    item[5].extend([("sample_rate", str(rate)), ("channels", str(channels))])
    return [item]


def _safetensors_items(path: Union[str, os.PathLike]) -> List[Tuple]:
    """Every tensor of a .safetensors file, read in place from the file by the sender, with
    the attributes that let a receiver rebuild the file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        size = os.fstat(f.fileno()).st_size
        if header_len > min(100 << 20, size - 8):
            raise TensorwireError(
                f"{path}: not a .safetensors file (its header length {header_len} is not "
                "plausible); .npy arrays and .safetensors files are sent from paths"
            )
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None)
    attrs = [(_FILE_ATTR, os.path.basename(path)), (_FILE_TENSORS_ATTR, str(len(header)))]
    if metadata is not None:
        attrs.append(
            (_FILE_METADATA_ATTR, json.dumps(metadata, separators=(",", ":"), sort_keys=True, ensure_ascii=False))
        )
    items = []
    for name in sorted(header):
        info = header[name]
        dtype = info["dtype"]
        if dtype not in _SIZES:
            raise TensorwireError(f"{path}: tensor {name!r}: dtype {dtype!r} is not supported")
        begin, end = info["data_offsets"]
        length = _SIZES[dtype]
        for dim in info["shape"]:
            length *= dim
        if not 0 <= begin <= end <= size - data_start or end - begin != length:
            raise TensorwireError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}) do not hold its {length} bytes"
            )
        items.append((name, dtype, list(info["shape"]), "file", (path, data_start + begin), list(attrs)))
    return items


def send(
    addr: str,
    tensors: "Tensors",
    *,
    connections: Optional[int] = None,
    split: bool = True,
    ca: Optional[str] = None,
    client_cert: Optional[str] = None,
    client_key: Optional[str] = None,
    server_name: str = "localhost",
    mtu: Optional[int] = None,
    device: Optional[str] = None,
    progress: Union[bool, Callable[[SendProgress], None]] = False,
    transport: str = "auto",
    attributes: Optional[Mapping[str, str]] = None,
) -> List[SendResult]:
    """Sends `tensors` (a name → tensor mapping, or a .safetensors path) to the receiver at
    `addr` ("host:port"), or a ``.npy`` or ``.wav`` path (one tensor, named after the file: a
    WAV's samples as F32, shape ``[frames]`` or ``[frames, channels]``, with ``sample_rate``
    and ``channels`` attributes, as ``sender`` reads it), and returns once each is
    acknowledged. `attributes` (string keys and values) go with every tensor, beside any the
    file gives; keys starting ``tensorwire.`` are the protocol's and refused.

    GPU tensors (PyTorch CUDA, CuPy) are read from device memory a chunk at a time, never
    copied to the host whole; host buffers are sent without a copy. `connections` (default:
    one per core, at most 8, and no more than the tensors or their 16 MiB parts can use)
    spreads the tensors over parallel connections; with `split` (the default), a tensor larger
    than its connection's share goes as parts of consecutive rows over several of them and
    lands whole (spec §15; `split=False` for receivers older than protocol 1.3, which would
    land the parts separately). `device` ("host", "cuda:N") asks the receiver to land them
    there (spec §5.2). `mtu` fixes the UDP payload size (default: 65507 to a loopback
    address; elsewhere 1200, then probing up to what the path carries; the smaller of the two
    sides' is used). `transport` is "quic" (UDP), "tcp" (QUIC over TCP, where UDP is blocked)
    or "auto" (the default: UDP, and TCP too if UDP completes no handshake within a second;
    spec §16). `progress` is a callback given a :class:`SendProgress` about ten times a
    second (an exception it raises stops the send), or True for a line on the terminal
    and one per tensor at the end.
    With no `ca`, development trust: a receiver on this host. Ctrl-C stops the send within a
    tenth of a second, cancelling what is in flight. Raises TensorwireError for the first
    tensor that failed, after the others ended: its ``sent`` lists those acknowledged, its
    ``failures`` every failure.
    """
    results, failures = _native.send(
        addr,
        _items(tensors, attributes),
        connections=connections,
        split=split,
        ca=ca,
        client_cert=client_cert,
        client_key=client_key,
        server_name=server_name,
        mtu=mtu,
        device=device,
        transport=transport,
        progress=_native_progress(progress),
    )
    return _sent(results, failures, progress)


Tensors = Union[Mapping[str, Any], str, "os.PathLike[str]"]


def _items(tensors: Tensors, attributes: Optional[Mapping[str, str]] = None) -> List[Tuple]:
    """What the native sender takes for `tensors`, each with the user's `attributes` and
    marked with this send's run."""
    user = _user_attributes(attributes)
    if isinstance(tensors, (str, os.PathLike)):
        items = _file_items(os.fspath(tensors))
    else:
        items = [_item(str(name), obj) for name, obj in tensors.items()]
    run = f"python-{os.getpid()}-{time.time_ns()}"
    for item in items:
        item[5].extend(user)
        item[5].append((_SENDER_ATTR, run))
    return items


def _file_items(path: str) -> List[Tuple]:
    """The tensors of a file, by its suffix: .npy, .wav, else .safetensors."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        return _npy_items(path)
    if suffix == ".wav":
        return _wav_items(path)
    return _safetensors_items(path)


def _user_attributes(attributes: Optional[Mapping[str, str]]) -> List[Tuple[str, str]]:
    """`attributes` as the wire's pairs; keys of the protocol's own (``tensorwire.``) are
    refused, so that a user's cannot pass for a split part or a file's layout."""
    pairs = []
    for key, value in (attributes or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"attribute {key!r}: keys and values are strings (got {type(value).__name__})")
        if key.startswith("tensorwire."):
            raise ValueError(f"attribute {key!r}: keys starting 'tensorwire.' are the protocol's")
        pairs.append((key, value))
    return pairs


def _native_progress(
    progress: Union[bool, Callable[["SendProgress"], None]],
) -> Optional[Callable[[int, int, List[Tuple[str, int, int]]], None]]:
    """What the native send calls with its counters: `progress` given a SendProgress."""
    if not progress:
        return None
    report = _print_progress if progress is True else progress

    def call(sent: int, total: int, tensors: List[Tuple[str, int, int]]) -> None:
        report(SendProgress(sent, total, {name: (done, size) for name, done, size in tensors}))

    return call


def _first_wins(pairs: List[Tuple[str, str]]) -> Dict[str, str]:
    """Key-value pairs (a receipt's, a reply's) as a dict: the first of a repeated key wins,
    as in attributes."""
    out: Dict[str, str] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


def _sent(results: List[Tuple], failures: List[TensorwireError], progress: Any) -> List[SendResult]:
    """The results of a send; raises the first failure, carrying the rest."""
    if progress is True and sys.stderr.isatty():
        print(file=sys.stderr)  # ends the progress line
    out = [
        SendResult(name, nbytes, seconds, SendWaits(*waited), _first_wins(entries))
        for name, nbytes, seconds, waited, entries in results
    ]
    if failures:
        first = failures[0]
        first.sent, first.failures = out, list(failures)
        raise first
    if progress is True:
        for r in out:
            landed = f" -> {r.device}" if r.device else ""
            shared = f", shared as {r.shared_id}" if r.shared_id else ""
            print(f"sent {r.name}: {r.nbytes} bytes in {r.seconds:.3f} s{landed}{shared} (waited: {r.waited})")
    return out


class Sender:
    """Connections to one receiver, opened once and kept for every :meth:`send` until
    :meth:`close` (or the end of ``with``): what :func:`send` does in a loop without the
    handshakes. Its arguments are :func:`send`'s (`connections` defaults to one per core, at
    most 8); so are :meth:`send`'s. Sends from several threads share the connections."""

    def __init__(
        self,
        addr: str,
        *,
        connections: Optional[int] = None,
        ca: Optional[str] = None,
        client_cert: Optional[str] = None,
        client_key: Optional[str] = None,
        server_name: str = "localhost",
        mtu: Optional[int] = None,
        transport: str = "auto",
    ) -> None:
        self._native = _native.Sender(
            addr,
            connections=connections,
            ca=ca,
            client_cert=client_cert,
            client_key=client_key,
            server_name=server_name,
            mtu=mtu,
            transport=transport,
        )

    @property
    def address(self) -> str:
        """The receiver's address."""
        return self._native.address

    @property
    def connections(self) -> int:
        """How many connections it holds."""
        return self._native.connections

    def send(
        self,
        tensors: Tensors,
        *,
        split: bool = True,
        device: Optional[str] = None,
        progress: Union[bool, Callable[["SendProgress"], None]] = False,
        attributes: Optional[Mapping[str, str]] = None,
    ) -> List[SendResult]:
        """Sends `tensors` as :func:`send` does, over the open connections."""
        results, failures = self._native.send(
            _items(tensors, attributes), split=split, device=device, progress=_native_progress(progress)
        )
        return _sent(results, failures, progress)

    async def send_async(self, tensors: Tensors, **kwargs: Any) -> List[SendResult]:
        """:meth:`send` without blocking the event loop (on a worker thread)."""
        return await asyncio.to_thread(self.send, tensors, **kwargs)

    def close(self) -> None:
        """Closes the connections; a send under way finishes first."""
        self._native.close()

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "Sender":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.close)


async def send_async(addr: str, tensors: Any, **kwargs: Any) -> List[SendResult]:
    """:func:`send` without blocking the event loop (it runs on a worker thread)."""
    return await asyncio.to_thread(send, addr, tensors, **kwargs)


SharedBuffer = _native.SharedBuffer


def empty(shape: Sequence[int], dtype: str = "F32", device: str = "cuda:0") -> "SharedBuffer":
    """A zeroed tensor in GPU memory other processes can map (VMM): view it with
    ``torch.from_dlpack(buf)`` or ``cupy.from_dlpack(buf)`` (any number of views, no copy),
    fill it, then :meth:`ShareService.publish` it."""
    return _native.empty(list(shape), dtype.upper(), device)


def _synchronize_frameworks() -> None:
    """Waits for work PyTorch and CuPy queued, so published bytes are written."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.cuda.Device().synchronize()
        except Exception:  # no device or no context: nothing was queued
            pass


class ShareService:
    """Publishes tensors to local processes on the Unix socket `path` (its directory is made
    mode 0700), as ``receiver --share`` does: consumers are ``tensorwire_ipc.Client``,
    ``tensorwire-share``, the C library. `on_existing`: "replace", "in-place" or "reject"
    for a name published again."""

    def __init__(self, path: Union[str, "os.PathLike[str]"], *, on_existing: str = "replace") -> None:
        self._native = _native.ShareService(os.fspath(path), on_existing=on_existing)

    @property
    def path(self) -> str:
        return str(self._native.path)

    def publish(self, name: str, tensor: Any) -> int:
        """Shares `tensor` as `name` and returns its generation. GPU memory goes with no copy
        (a consumer's writes are seen here): a :func:`empty` buffer, or a framework's tensor
        (PyTorch, CuPy), which this service keeps alive until the name is replaced or deleted
        and the last consumer lets go; consumers can map the rest of the allocation it lies
        in, as with PyTorch's own CUDA IPC. PyTorch's expandable segments
        (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) cannot be shared this way:
        use :func:`empty`. Host arrays (NumPy, PyTorch CPU, bytes) are copied once into
        shared memory."""
        _synchronize_frameworks()
        if isinstance(tensor, SharedBuffer):
            return self._native.publish_device(name, tensor)
        return self._native.publish(_item(name, tensor))

    def names(self) -> List[str]:
        """The names shared now."""
        return self._native.names()

    def delete(self, name: str) -> bool:
        """Unshares `name`; True if consumers still hold it (its memory goes when they let
        go). An unknown name raises TensorwireError."""
        return self._native.delete(name)


class ReceivedTensor:
    """A tensor that landed. Hand it to a framework with no copy, once:
    ``torch.from_dlpack(t)``, ``cupy.from_dlpack(t)``, ``np.from_dlpack(t)`` (host), or
    :meth:`numpy` / :meth:`torch`. The memory returns to the receiver's pool when the
    framework's tensor (or this object, if never handed over) is freed."""

    __slots__ = ("_t",)

    def __init__(self, native: Any) -> None:
        self._t = native

    @property
    def name(self) -> str:
        """The tensor's name."""
        return str(self._t.name)

    @property
    def dtype(self) -> str:
        """Its dtype name (spec §5.1), e.g. 'F32'."""
        return str(self._t.dtype)

    @property
    def shape(self) -> Tuple[int, ...]:
        """Its shape."""
        return tuple(self._t.shape)

    @property
    def attributes(self) -> Dict[str, str]:
        """The sender's attributes."""
        return dict(self._t.attributes)

    @property
    def device(self) -> str:
        """'cuda:N' or 'cpu'."""
        return str(self._t.device)

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return int(self._t.nbytes)

    @property
    def data_ptr(self) -> int:
        """Address of its first byte."""
        return int(self._t.data_ptr)

    @property
    def peer(self) -> str:
        """The sender's address."""
        return str(self._t.peer)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        return self._t.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._t.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """The CUDA Array Interface (v3) of a tensor on the GPU (CuPy, Numba, PyTorch read
        it): the same memory, no copy, valid while this object holds it. BF16 and FP8 appear
        as bytes (shape ``(nbytes,)``). Host tensors, and tensors handed over through DLPack
        or released, have none (AttributeError)."""
        return dict(self._t.__cuda_array_interface__)

    def tobytes(self) -> bytes:
        """A host copy of the bytes."""
        return self._t.tobytes()

    def release(self) -> None:
        """Gives the memory back now."""
        self._t.release()

    def numpy(self) -> "np.ndarray":
        """A NumPy array: no copy for host tensors of NumPy types; BF16 and FP8 come as their
        raw bits (uint16 / uint8). GPU tensors are copied to the host."""
        import numpy as np

        raw = {"BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}
        if self.dtype in raw or self.device != "cpu":
            kind = raw.get(self.dtype) or np.dtype(_DTYPE_TO_NUMPY[self.dtype])
            return np.frombuffer(self.tobytes(), dtype=kind).reshape(self.shape)
        return np.from_dlpack(self)

    def torch(self) -> Any:
        """A PyTorch tensor on the same memory, no copy."""
        import torch

        return torch.from_dlpack(self)

    def __repr__(self) -> str:
        return f"ReceivedTensor({self.name!r}, {self.dtype} {list(self.shape)}, {self.device})"


class Receiver:
    """Listens on `listen` and lands tensors on a GPU (`device`: "auto", "cuda:N", "host").

    Iterate it (or ``async for``) to take tensors as they land; ``recv(timeout)`` for one.
    Memory is admitted against budgets before any byte is accepted: a credit budget of
    `budget_mib`, host memory of `host_memory_mib` (default a quarter of RAM), and device
    memory; `require_gpu` makes a missing GPU an error instead of host memory. `mtu` fixes
    the UDP payload size it sends and takes (default: 65507 on a loopback address; elsewhere,
    every address included, it takes up to 65507, and its own packets start at 1200 and probe
    up). `metrics` ("host:port") serves Prometheus metrics over plain HTTP at
    ``http://host:port/metrics``, as ``receiver --metrics-listen`` does (docs/operators.md
    lists them); :meth:`metrics_text` gives the same text for a server of your own.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        device: str = "auto",
        require_gpu: bool = False,
        budget_mib: int = 256,
        host_memory_mib: Optional[int] = None,
        admission_timeout_s: float = 30.0,
        cert: Optional[str] = None,
        key: Optional[str] = None,
        client_ca: Optional[str] = None,
        mtu: Optional[int] = None,
        metrics: Optional[str] = None,
    ) -> None:
        self._native = _native.Receiver(
            listen,
            device=device,
            require_gpu=require_gpu,
            budget_mib=budget_mib,
            host_memory_mib=host_memory_mib,
            admission_timeout_s=admission_timeout_s,
            cert=cert,
            key=key,
            client_ca=client_ca,
            mtu=mtu,
            metrics=metrics,
        )
        if device == "auto" and self.placement.startswith("host memory"):
            # Never a silent fallback: say where tensors go, and why.
            warnings.warn(f"tensorwire: tensors will land in {self.placement}", stacklevel=2)

    @property
    def address(self) -> str:
        """The address it listens on, "host:port"."""
        return self._native.address

    @property
    def placement(self) -> str:
        """Where tensors land, and why (for host memory)."""
        return self._native.placement

    @property
    def metrics_address(self) -> Optional[str]:
        """Where Prometheus scrapes its metrics ("host:port", path ``/metrics``), or None."""
        return self._native.metrics_address

    def metrics_text(self) -> str:
        """Every metric now, in the OpenMetrics text format (what a scrape returns)."""
        return self._native.metrics_text()

    @property
    def development_certificate(self) -> Optional[str]:
        """The PEM of the self-signed certificate it made when no `cert` was given (None
        otherwise): written to a file senders on this host find, and what a sender on another
        host trusts, as `ca`, once it has it by a channel it already trusts."""
        return self._native.development_certificate

    def recv(self, timeout: Optional[float] = None) -> ReceivedTensor:
        """The next tensor; :class:`ReceiveTimeout` (a TimeoutError) after `timeout` seconds,
        :class:`ReceiverClosed` (an EOFError) once closed."""
        try:
            return ReceivedTensor(self._native.recv(timeout))
        except TimeoutError as e:
            raise ReceiveTimeout(str(e)) from None
        except EOFError as e:
            raise ReceiverClosed(str(e)) from None

    def failures(self) -> List[str]:
        """The latest tensors that failed (up to 1024, oldest first), each with its sender,
        code and cause."""
        return self._native.failures()

    def pool_stats(self) -> Dict[str, Dict[str, int]]:
        """GPU pool statistics: ``{"device": {...}, "staging": {...}}`` (empty on the host).

        ``device["outside_pool"]`` counts tensors that got device memory of their own because
        the pool was full or its buffers too small; freeing such memory may stall copies.
        """
        return self._native.pool_stats()

    def close(self) -> None:
        """Stops listening."""
        self._native.close()

    def __iter__(self) -> Iterator[ReceivedTensor]:
        return self

    def __next__(self) -> ReceivedTensor:
        try:
            return self.recv()
        except EOFError:
            raise StopIteration from None

    def __aiter__(self) -> "Receiver":
        return self

    async def __anext__(self) -> ReceivedTensor:
        try:
            return await asyncio.to_thread(self.recv)
        except EOFError:
            raise StopAsyncIteration from None

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
