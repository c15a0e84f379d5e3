"""Kernels run on a receiver's GPU (spec §14): the Python client of ``receiver --allow-exec``.

    import numpy as np
    from tensorwire.exec import Client, Input, Output, Scalar

    x = np.arange(1024, dtype=np.float32)
    with Client("gpu-host:7000") as gpu:
        print(gpu.health())                       # {"workers": "2", ...}
        result = gpu.run("kernels.ptx", "add", grid=(4,), block=(256,),
                         args=[Input("in", x), Output("out", "F32", (1024,)),
                               Scalar("delta", "F32", 1.5), Scalar("n", "I32", 1024)])
        y = result.outputs["out"]                 # a NumPy array
        print(result.timings)                     # landing, kernel, egress, total

The module (PTX, cubin or fatbin) is sent only when the server does not hold it already:
runs after the first send its hash. Arguments go to the kernel in the order given: inputs
and outputs as device pointers, scalars by value. The server allows this only to
authenticated peers (mutual TLS), to peers with its access token, or, listening on
loopback, to local ones.
"""

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _DTYPE_TO_NUMPY, _NUMPY_TO_DTYPE, _first_wins, _native
from .errors import TensorwireError

__all__ = ["Client", "Input", "Output", "RunResult", "RunTimings", "Scalar"]

# Outputs of dtypes NumPy lacks come back as their raw bits.
_RAW_BITS = {"BF16": "<u2", "F8_E4M3": "|u1", "F8_E5M2": "|u1"}


@dataclass(frozen=True)
class Input:
    """A tensor the kernel reads: sent to the server, passed as a device pointer. `array` is
    anything NumPy takes (a host array); `dtype` names a dtype NumPy lacks (``"BF16"``) for
    an array of its raw bits."""

    name: str
    array: Any
    dtype: Optional[str] = None


@dataclass(frozen=True)
class Output:
    """A tensor the kernel writes: allocated zeroed on the server, passed as a device
    pointer, returned in :attr:`RunResult.outputs`."""

    name: str
    dtype: str
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Scalar:
    """A value passed to the kernel by value, as `dtype` (``"I32"``, ``"F32"``, …)."""

    name: str
    dtype: str
    value: Union[int, float, bool]


@dataclass(frozen=True)
class RunTimings:
    """The server's clock (spec §14.3), in seconds."""

    #: The request's arrival → every input and the module resident on the GPU.
    landing: float
    #: The kernel alone, between CUDA events around its launch.
    kernel: float
    #: The kernel's end → every output acknowledged by this client.
    egress: float
    #: The request's arrival → the reply.
    total: float


@dataclass(frozen=True)
class RunResult:
    """What a run gave back."""

    #: Each output by name: a NumPy array (BF16 and FP8 as their raw bits).
    outputs: Dict[str, Any]
    timings: RunTimings
    #: Whether the module's bytes were sent (the server did not hold it).
    module_sent: bool
    #: Bytes of module, inputs and outputs moved.
    bytes_moved: int
    #: Request sent → reply received, on this side's clock, in seconds.
    round_trip: float
    #: The reply's attributes (cache use).
    attributes: Dict[str, str] = field(default_factory=dict)


Arg = Union[Input, Output, Scalar]


class Client:
    """A connection to a receiver that runs kernels (``receiver --allow-exec``), kept open
    across calls until :meth:`close` (or the end of ``with``). TLS as :func:`tensorwire.send`
    takes it: no `ca` trusts a development receiver on this host. `token` (or `token_file`,
    readable by its owner only) is the access token of a receiver started with
    ``--exec-token-file`` (spec §14.6), sent only inside TLS. Failures raise
    :class:`TensorwireError` with the wire code (``UNSUPPORTED_DEVICE`` from a server with
    no GPU, ``KERNEL_FAULT`` for a kernel that faulted, …)."""

    def __init__(
        self,
        addr: str,
        *,
        ca: Optional[str] = None,
        client_cert: Optional[str] = None,
        client_key: Optional[str] = None,
        server_name: str = "localhost",
        transport: str = "auto",
        token: Optional[str] = None,
        token_file: Optional[str] = None,
    ) -> None:
        self._native = _native.ExecClient(
            addr, ca=ca, client_cert=client_cert, client_key=client_key,
            server_name=server_name, transport=transport, token=token, token_file=token_file,
        )

    @property
    def address(self) -> str:
        """The server's address."""
        return self._native.address

    def info(self) -> Dict[str, str]:
        """The server and its GPU: ``exec``, ``device.name``, ``device.memory_total``, …"""
        return _first_wins(self._native.info())

    def health(self) -> Dict[str, str]:
        """Whether the server can run kernels now: ``workers``, cache use, …"""
        return _first_wins(self._native.health())

    def run(
        self,
        module: Union[bytes, str, "os.PathLike[str]"],
        function: str,
        *,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[Arg],
        shared_mem_bytes: int = 0,
        time_limit: Optional[float] = None,
        format: Optional[str] = None,
    ) -> RunResult:
        """Runs `function` of `module` (bytes, or a path to a .ptx, .cubin or .fatbin file)
        on `grid` × `block` threads (1 to 3 dimensions each) over `args`, in the kernel's
        parameter order; `time_limit` in seconds (the server's own limit otherwise)."""
        import numpy as np

        code = module if isinstance(module, bytes) else _read(module)
        wire: List[Tuple[str, str, str, List[int], Optional[bytes]]] = []
        for arg in args:
            if isinstance(arg, Input):
                array = np.ascontiguousarray(arg.array)
                dtype = arg.dtype or _NUMPY_TO_DTYPE.get(array.dtype.str)
                if dtype is None:
                    raise TypeError(f"input {arg.name}: NumPy dtype {array.dtype} has no tensorwire dtype")
                wire.append(("input", arg.name, dtype, list(array.shape), array.tobytes()))
            elif isinstance(arg, Output):
                wire.append(("output", arg.name, arg.dtype, [int(d) for d in arg.shape], None))
            elif isinstance(arg, Scalar):
                kind = _DTYPE_TO_NUMPY.get(arg.dtype.upper())
                if kind is None:
                    raise ValueError(f"scalar {arg.name}: dtype {arg.dtype!r} has no scalar form")
                wire.append(("scalar", arg.name, arg.dtype, [], np.array(arg.value, dtype=kind).tobytes()))
            else:
                raise TypeError(f"argument {arg!r}: an Input, Output or Scalar")
        limit_ms = None if time_limit is None else max(1, int(time_limit * 1000))
        outputs, timings, module_sent, moved, round_trip, attributes = self._native.run(
            code, function, wire, grid=_dims(grid, "grid"), block=_dims(block, "block"),
            format=format, shared_mem_bytes=shared_mem_bytes, time_limit_ms=limit_ms,
        )
        arrays = {name: _array(dtype, shape, data) for name, dtype, shape, data in outputs}
        return RunResult(arrays, RunTimings(*timings), module_sent, moved, round_trip, _first_wins(attributes))

    def close(self) -> None:
        """Closes the connection."""
        self._native.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read(path: Union[str, "os.PathLike[str]"]) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TensorwireError(f"{os.fspath(path)}: {e.strerror}") from None


def _dims(dims: Sequence[int], what: str) -> Tuple[int, int, int]:
    """1 to 3 dimensions, the rest 1."""
    values = [int(d) for d in dims]
    if not 1 <= len(values) <= 3 or any(d < 1 for d in values):
        raise ValueError(f"{what} {tuple(dims)}: 1 to 3 dimensions, each at least 1")
    padded = values + [1] * (3 - len(values))
    return (padded[0], padded[1], padded[2])


def _array(dtype: str, shape: List[int], data: bytes) -> Any:
    import numpy as np

    kind = _DTYPE_TO_NUMPY.get(dtype) or _RAW_BITS[dtype]
    return np.frombuffer(data, dtype=kind).reshape(shape)

