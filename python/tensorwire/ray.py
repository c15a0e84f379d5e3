"""A Ray tensor transport over tensorwire: actor methods decorated with
``@ray.method(tensor_transport="tensorwire")`` hand their tensors to the actors that use them
over QUIC (UDP, or TCP where UDP is blocked), node to node, with no NCCL group, no RDMA and
no object store in between::

    import ray, torch, tensorwire.ray

    tensorwire.ray.register()          # in the driver, before the actor classes are defined

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="tensorwire")
        def weights(self):
            return {"w": torch.randn(4096, 4096)}

    @ray.remote(enable_tensor_transport=True)   # it receives: its transfers get a thread
    class Inference:
        def load(self, weights):
            return float(weights["w"].sum())

    trainer, server = Trainer.remote(), Inference.remote()
    ray.get(server.load.remote(trainer.weights.remote()))

Actors that receive such tensors are created with ``enable_tensor_transport=True`` (Ray then
runs transfers on a thread of their own; without it, a task waiting for its tensors can stand
before the transfer that brings them, until Ray's 60 s timeout). Each destination actor starts a tensorwire receiver the first time a tensor is sent to it
(on its node's address, a free port) and keeps it for its lifetime; CUDA tensors land in its
GPU's memory, CPU tensors in host memory. The transfer is two-sided in Ray's terms: the
source pushes (``send_multiple_tensors``), the destination waits for what landed
(``recv_multiple_tensors``); either may abort, and a failed transfer raises in the task that
needed the tensors, with the tensorwire code and cause, without killing the actors. (Ray's
own handling of a failed transfer imports PyTorch in the driver: install it there.)

Each destination publishes its receiver's address in Ray's key-value store (the GCS) when its
first transfer starts, and withdraws it when it exits; sources look it up there.

Trust: by default each receiver makes a self-signed certificate that it publishes with its
address (senders trust that one certificate, nothing else), so the bytes are encrypted and
go only to the actor Ray chose; the receiver admits any peer that reaches it,
against its memory budget. On networks shared with others, give ``cert``/``key`` (every
node's receiver) with ``client_ca`` and ``client_cert``/``client_key`` (every sender): mutual
TLS, as ``receiver``/``sender`` take them. The files must exist on every node.

Tested with Ray 2.55 and 2.60 (CI pins 2.60); Rays before 2.55 lack
``register_tensor_transport``'s ``data_type`` argument.
"""

import atexit
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import ray
from ray.experimental import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
    internal_kv,
    register_tensor_transport,
)

import tensorwire

from .errors import TensorwireError

__all__ = ["Settings", "TensorwireTransport", "register"]

#: The name methods give as ``tensor_transport`` (Ray compares names in upper case).
DEFAULT_NAME = "tensorwire"
# Where destination actors publish their receivers in Ray's key-value store.
_KV_NAMESPACE = "tensorwire"
# Destinations a source keeps connections to at once.
_MAX_SENDERS = 64


@dataclass(frozen=True)
class Settings:
    """How every process of the job sends and receives; set once, by :func:`register`."""

    #: The transport's name in ``@ray.method(tensor_transport=...)``.
    name: str = DEFAULT_NAME
    #: Where destination receivers listen: their node's address by default.
    listen_host: Optional[str] = None
    #: Where received tensors land ("auto": the actor's GPU if it has one; "host").
    device: str = "auto"
    #: Each receiver's credit budget and host memory budget (MiB; None: a quarter of RAM).
    budget_mib: int = 256
    host_memory_mib: Optional[int] = None
    #: Seconds a tensor waits for memory at a receiver before it is refused.
    admission_timeout_s: float = 30.0
    #: Parallel connections per send (None: tensorwire's default).
    connections: Optional[int] = None
    #: "quic", "tcp" or "auto" (spec §16).
    transport: str = "auto"
    #: Seconds a tensor that landed waits for the destination to take it before it is let
    #: go (its transfer was aborted, or it was never asked for).
    unclaimed_timeout_s: float = 120.0
    #: Seconds a source waits for a destination actor to publish its receiver.
    lookup_timeout_s: float = 60.0
    #: Mutual TLS: the receivers' certificate and key, the CA their senders' certificates
    #: chain to; the CA senders check receivers against, and the senders' own identity.
    cert: Optional[str] = None
    key: Optional[str] = None
    client_ca: Optional[str] = None
    ca: Optional[str] = None
    client_cert: Optional[str] = None
    client_key: Optional[str] = None
    server_name: str = "localhost"


def register(
    name: str = DEFAULT_NAME,
    *,
    data_type: Optional[type] = None,
    devices: Sequence[str] = ("cpu", "cuda"),
    **settings: Any,
) -> type:
    """Registers the transport with Ray as `name`; call it in the driver before defining the
    actor classes that use it. `data_type` is what Ray hands over (default ``torch.Tensor``,
    or ``numpy.ndarray`` where PyTorch is not installed); `settings` are :class:`Settings`'
    fields. Returns the registered class."""
    config = Settings(name=name, **settings)
    if (config.cert is None) != (config.key is None):
        raise ValueError("cert and key go together")
    if (config.client_cert is None) != (config.client_key is None):
        raise ValueError("client_cert and client_key go together")
    if config.ca is None and config.cert is not None:
        raise ValueError("receivers with a certificate of their own need senders to know its CA: give ca")
    if data_type is None:
        data_type = _default_data_type()
    # A subclass that carries the settings to every actor (Ray pickles it by value).
    transport = type("TensorwireTransport", (TensorwireTransport,), {"settings": config})
    register_tensor_transport(name, list(devices), transport, data_type)
    return transport


def _default_data_type() -> type:
    try:
        import torch

        return torch.Tensor
    except ImportError:
        import numpy

        return numpy.ndarray


@dataclass
class TensorwireTransportMetadata(TensorTransportMetadata):
    """What the source made: each tensor's shape and dtype, and the object they belong to
    (their names on the wire are ``OBJECT/INDEX``)."""

    obj_id: str = ""


@dataclass
class TensorwireCommunicatorMetadata(CommunicatorMetadata):
    """The destination actor, whose receiver the source looks up."""

    dst_actor_id: str = ""


@dataclass(frozen=True)
class _Endpoint:
    """Where an actor's receiver listens, and the certificate to trust there (its
    development certificate, when it has no CA-issued one)."""

    address: str
    certificate: Optional[str]

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "certificate": self.certificate}).encode()

    @staticmethod
    def decode(raw: bytes) -> "_Endpoint":
        fields = json.loads(raw)
        return _Endpoint(str(fields["address"]), fields.get("certificate"))


@dataclass
class _Landed:
    """Tensors of one object that landed, by index, and since when the first waited."""

    tensors: Dict[int, "tensorwire.ReceivedTensor"] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)


class TensorwireTransport(TensorTransportManager):
    """Ray's ``TensorTransportManager`` over tensorwire; :func:`register` makes the class Ray
    uses, with its :class:`Settings`."""

    settings: ClassVar[Settings] = Settings()

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._receiver: Optional[tensorwire.Receiver] = None
        self._landed: Dict[str, _Landed] = {}
        # Objects aborted here, and when: what lands for them later is let go.
        self._aborted: Dict[str, float] = {}
        # On a source: each destination actor's endpoint, looked up once.
        self._endpoints: Dict[str, _Endpoint] = {}
        # On a source: the files written for `ca`, by certificate; the connections kept, by
        # destination address (least recently used first).
        self._trust_files: Dict[str, str] = {}
        self._senders: Dict[str, "tensorwire.Sender"] = {}

    def tensor_transport_backend(self) -> str:
        return self.settings.name.upper()

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
        # Every actor of the job imports this package (it is how Ray unpickles this class).
        return True

    # --- on the source ---------------------------------------------------------------------

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: List[Any]) -> TensorwireTransportMetadata:
        tensor_meta: List[Tuple[Any, Any]] = []
        device: Optional[str] = None
        for tensor in rdt_object:
            kind = _device_type(tensor)
            if device is not None and kind != device:
                raise ValueError("all tensors of one object must be on one kind of device")
            device = kind
            tensor_meta.append((tensor.shape, tensor.dtype))
        return TensorwireTransportMetadata(tensor_meta=tensor_meta, tensor_device=device, obj_id=obj_id)

    def send_multiple_tensors(
        self,
        tensors: List[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        assert isinstance(tensor_transport_metadata, TensorwireTransportMetadata)
        assert isinstance(communicator_metadata, TensorwireCommunicatorMetadata)
        obj_id = tensor_transport_metadata.obj_id
        with self._lock:
            if obj_id in self._aborted:
                raise TensorwireError(f"the transfer of {obj_id} was aborted before it was sent")
        config = self.settings
        endpoint = self._endpoint_of(communicator_metadata.dst_actor_id)
        ca = config.ca
        if endpoint.certificate is not None:
            ca = self._trust_file(endpoint.certificate)
        named = {f"{obj_id}/{index}": tensor for index, tensor in enumerate(tensors)}
        # CPU tensors land in host memory there too; CUDA ones in the destination's GPU.
        device = "host" if tensor_transport_metadata.tensor_device == "cpu" else None
        try:
            self._sender_to(endpoint.address, ca).send(named, device=device)
        except Exception:
            # A restarted actor listens elsewhere: look it up, and connect, again next time.
            with self._lock:
                self._endpoints.pop(communicator_metadata.dst_actor_id, None)
                stale = self._senders.pop(endpoint.address, None)
            if stale is not None:
                stale.close()
            raise

    def _sender_to(self, address: str, ca: Optional[str]) -> "tensorwire.Sender":
        """Connections to `address`, opened with the first transfer there and kept for the
        next (the least recently used let go past `_MAX_SENDERS` destinations)."""
        with self._lock:
            sender = self._senders.pop(address, None)
            if sender is not None:
                self._senders[address] = sender  # now the most recently used
                return sender
        config = self.settings
        sender = tensorwire.Sender(
            address,
            connections=config.connections,
            ca=ca,
            client_cert=config.client_cert,
            client_key=config.client_key,
            server_name=config.server_name,
            transport=config.transport,
        )
        with self._lock:
            self._senders[address] = sender
            evicted = [self._senders.pop(a) for a in list(self._senders)[: max(0, len(self._senders) - _MAX_SENDERS)]]
        for old in evicted:
            old.close()
        return sender

    def _endpoint_of(self, actor_id: str) -> _Endpoint:
        """The receiver of `actor_id`, which it publishes when its first transfer starts."""
        with self._lock:
            endpoint = self._endpoints.get(actor_id)
        deadline = time.monotonic() + self.settings.lookup_timeout_s
        while endpoint is None:
            raw = internal_kv._internal_kv_get(self._endpoint_key(actor_id), namespace=_KV_NAMESPACE)
            if raw is not None:
                endpoint = _Endpoint.decode(raw)
                with self._lock:
                    self._endpoints[actor_id] = endpoint
            elif time.monotonic() > deadline:
                raise TensorwireError(
                    f"actor {actor_id} published no tensorwire receiver within "
                    f"{self.settings.lookup_timeout_s:.0f} s (is it alive, and was it created "
                    "with enable_tensor_transport=True?)"
                )
            else:
                time.sleep(0.02)
        return endpoint

    def _endpoint_key(self, actor_id: str) -> str:
        return f"{self.tensor_transport_backend()}/{actor_id}"

    def _trust_file(self, certificate: str) -> str:
        """A file holding `certificate`, for `ca`: written once per certificate (a restarted
        destination has a new one)."""
        with self._lock:
            path = self._trust_files.get(certificate)
            if path is None:
                handle, path = tempfile.mkstemp(prefix="tensorwire-ray-", suffix=".pem")
                atexit.register(_remove_quietly, path)
                with os.fdopen(handle, "w") as f:
                    f.write(certificate)
                self._trust_files[certificate] = path
            return path

    def garbage_collect(self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: List[Any]) -> None:
        # The source's tensors are Ray's; the bytes sent hold nothing here.
        return None

    # --- on the owner ----------------------------------------------------------------------

    def get_communicator_metadata(
        self,
        src_actor: "ray.actor.ActorHandle",
        dst_actor: "ray.actor.ActorHandle",
        backend: Optional[str] = None,
    ) -> TensorwireCommunicatorMetadata:
        # Asking the destination here would block Ray's callback thread: the source looks
        # its receiver up in Ray's key-value store instead, where the destination put it.
        return TensorwireCommunicatorMetadata(dst_actor_id=dst_actor._actor_id.hex())

    # --- on the destination ----------------------------------------------------------------

    def _ensure_receiver(self) -> "tensorwire.Receiver":
        with self._lock:
            if self._receiver is not None:
                return self._receiver
            actor_id = ray.get_runtime_context().get_actor_id()
            if actor_id is None:
                raise TensorwireError("tensors of this transport are received by actors, not by a driver or task")
            config = self.settings
            host = config.listen_host or ray.util.get_node_ip_address()
            receiver = tensorwire.Receiver(
                f"{host}:0",
                device=config.device,
                budget_mib=config.budget_mib,
                host_memory_mib=config.host_memory_mib,
                admission_timeout_s=config.admission_timeout_s,
                cert=config.cert,
                key=config.key,
                client_ca=config.client_ca,
            )
            self._receiver = receiver
            threading.Thread(target=self._file_landed, args=(receiver,), name="tensorwire-ray", daemon=True).start()
            # Published for sources (see _endpoint_of), and withdrawn when this actor ends.
            key = self._endpoint_key(actor_id)
            endpoint = _Endpoint(receiver.address, receiver.development_certificate)
            internal_kv._internal_kv_put(key, endpoint.encode(), overwrite=True, namespace=_KV_NAMESPACE)
            atexit.register(internal_kv._internal_kv_del, key, namespace=_KV_NAMESPACE)
            return receiver

    def _file_landed(self, receiver: "tensorwire.Receiver") -> None:
        """Files each tensor that lands under its object until a transfer takes it; lets go of
        what nobody takes in time."""
        while True:
            try:
                tensor = receiver.recv(timeout=1.0)
            except TimeoutError:
                self._let_go_unclaimed()
                continue
            except EOFError:
                return
            obj_id, _, index = tensor.name.rpartition("/")
            with self._lock:
                if obj_id in self._aborted or not index.isdigit():
                    tensor.release()
                    continue
                self._landed.setdefault(obj_id, _Landed()).tensors[int(index)] = tensor
                self._lock.notify_all()

    def _let_go_unclaimed(self) -> None:
        deadline = time.monotonic() - self.settings.unclaimed_timeout_s
        with self._lock:
            for obj_id in [o for o, landed in self._landed.items() if landed.since < deadline]:
                self._release(obj_id)
            for obj_id in [o for o, when in self._aborted.items() if when < deadline]:
                del self._aborted[obj_id]

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[List[Any]] = None,
    ) -> List[Any]:
        self._ensure_receiver()
        count = len(tensor_transport_metadata.tensor_meta)
        with self._lock:
            # Ends when every tensor landed, or the transfer was aborted, or this receiver
            # refused or lost one of them (checked twice a second); Ray bounds it too.
            while True:
                if self._lock.wait_for(
                    lambda: obj_id in self._aborted or len(self._landed.get(obj_id, _Landed()).tensors) == count,
                    timeout=0.5,
                ):
                    break
                failed = self._failures_of(obj_id)
                if failed:
                    self._aborted[obj_id] = time.monotonic()
                    self._release(obj_id)
                    raise TensorwireError(f"the transfer of {obj_id} failed{failed}")
            if obj_id in self._aborted:
                raise TensorwireError(f"the transfer of {obj_id} was aborted{self._failures_of(obj_id)}")
            landed = self._landed.pop(obj_id, _Landed()).tensors
        out = []
        for index, (shape, dtype) in enumerate(tensor_transport_metadata.tensor_meta):
            tensor = _as_framework(landed[index], shape, dtype, tensor_transport_metadata.tensor_device)
            if target_buffers is not None:
                target_buffers[index].copy_(tensor)
                tensor = target_buffers[index]
            out.append(tensor)
        return out

    def _failures_of(self, obj_id: str) -> str:
        """Why this receiver refused or lost tensors of `obj_id`, if it did."""
        receiver = self._receiver
        failed = [f for f in receiver.failures() if f.startswith(f"{obj_id}/")] if receiver else []
        return ": " + "; ".join(failed) if failed else ""

    # --- either side -----------------------------------------------------------------------

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        with self._lock:
            self._aborted[obj_id] = time.monotonic()
            self._release(obj_id)
            self._lock.notify_all()

    def _release(self, obj_id: str) -> None:
        """Lets go of what landed of `obj_id` (the lock held)."""
        for tensor in self._landed.pop(obj_id, _Landed()).tensors.values():
            tensor.release()


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _device_type(tensor: Any) -> str:
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", None)
    if isinstance(kind, str):
        return kind  # PyTorch
    if type(tensor).__module__.split(".")[0] == "numpy":
        return "cpu"
    if hasattr(tensor, "__cuda_array_interface__"):
        return "cuda"
    raise TypeError(f"{type(tensor).__name__} is neither a PyTorch tensor nor a NumPy array")


def _as_framework(tensor: "tensorwire.ReceivedTensor", shape: Any, dtype: Any, device: Optional[str]) -> Any:
    """`tensor` as the source's framework had it (shape, dtype, kind of device), without a
    copy where the memory allows."""
    landed_on = "cpu" if tensor.device == "cpu" else "cuda"
    if landed_on != device:
        raise TensorwireError(
            f"{tensor.name}: sent from {device} memory, landed in {tensor.device}: "
            "this actor's receiver has no GPU for it (give the actor one, or send CPU tensors)",
            tensor=tensor.name,
        )
    if type(dtype).__module__.split(".")[0] == "torch":
        import torch

        out = torch.from_dlpack(tensor)
        if out.dtype != dtype:  # BF16 and FP8 travel as their bits
            out = out.view(dtype)
        return out.reshape(tuple(shape))
    import numpy as np

    return tensor.numpy().view(np.dtype(dtype)).reshape(tuple(shape))
