"""Types of the native module (crates/tensorwire-py). Use the `tensorwire` package's API."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

VERSION: str

def send(
    addr: str,
    items: Sequence[Tuple[str, str, Sequence[int], str, Any, Sequence[Tuple[str, str]]]],
    *,
    connections: Optional[int] = None,
    split: bool = True,
    ca: Optional[str] = None,
    client_cert: Optional[str] = None,
    client_key: Optional[str] = None,
    server_name: str = "localhost",
    mtu: Optional[int] = None,
    device: Optional[str] = None,
    transport: str = "auto",
    progress: Optional[Callable[[int, int, List[Tuple[str, int, int]]], None]] = None,
) -> Tuple[
    List[Tuple[str, int, float, Tuple[float, float, float, float], List[Tuple[str, str]]]], List[Any]
]: ...
class ExecClient:
    address: str
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
    ) -> None: ...
    def info(self) -> List[Tuple[str, str]]: ...
    def health(self) -> List[Tuple[str, str]]: ...
    def run(
        self,
        module: bytes,
        function: str,
        args: Sequence[Tuple[str, str, str, List[int], Optional[bytes]]],
        *,
        grid: Tuple[int, int, int],
        block: Tuple[int, int, int],
        format: Optional[str] = None,
        shared_mem_bytes: int = 0,
        time_limit_ms: Optional[int] = None,
    ) -> Tuple[
        List[Tuple[str, str, List[int], bytes]],
        Tuple[float, float, float, float],
        bool,
        int,
        float,
        List[Tuple[str, str]],
    ]: ...
    def close(self) -> None: ...

class Sender:
    address: str
    connections: int
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
    ) -> None: ...
    def send(
        self,
        items: Sequence[Tuple[str, str, Sequence[int], str, Any, Sequence[Tuple[str, str]]]],
        *,
        split: bool = True,
        device: Optional[str] = None,
        progress: Optional[Callable[[int, int, List[Tuple[str, int, int]]], None]] = None,
    ) -> Tuple[
    List[Tuple[str, int, float, Tuple[float, float, float, float], List[Tuple[str, str]]]], List[Any]
]: ...
    def close(self) -> None: ...

def gpu_status() -> Tuple[bool, int, str]: ...
def devices() -> List[Dict[str, Any]]: ...
def pinned_datagram_stats() -> Tuple[int, int, int, int, int]: ...

class ReceivedTensor:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    attributes: Dict[str, str]
    device: str
    nbytes: int
    data_ptr: int
    peer: str
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...
    def tobytes(self) -> bytes: ...
    def release(self) -> None: ...

class Receiver:
    address: str
    placement: str
    metrics_address: Optional[str]
    development_certificate: Optional[str]
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
    ) -> None: ...
    def metrics_text(self) -> str: ...
    def recv(self, timeout: Optional[float] = None) -> ReceivedTensor: ...
    def failures(self) -> List[str]: ...
    def pool_stats(self) -> Dict[str, Dict[str, int]]: ...
    def close(self) -> None: ...

class SharedBuffer:
    dtype: str
    shape: Tuple[int, ...]
    device: str
    data_ptr: int
    nbytes: int
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

def empty(shape: Sequence[int], dtype: str, device: str) -> SharedBuffer: ...

class ShareService:
    path: str
    def __init__(self, path: str, *, on_existing: str = "replace") -> None: ...
    def publish_device(self, name: str, buffer: SharedBuffer) -> int: ...
    def publish(self, item: Tuple[str, str, Sequence[int], str, Any, Sequence[Tuple[str, str]]]) -> int: ...
    def names(self) -> List[str]: ...
    def delete(self, name: str) -> bool: ...
