"""The base of every exception tensorwire raises, here so that the pure-Python consumer
(`tensorwire_ipc`) shares it without the native module; `tensorwire.errors` re-exports it."""

from typing import Any, List, Optional


class TensorwireError(Exception):
    """A tensorwire operation failed.

    Attributes:
        code: the wire error code (spec §9.2), or None where the failure had none (a
            connection that could not be made, a bad certificate).
        code_name: the code's registered name, e.g. ``"TENSOR_TOO_LARGE"``.
        blame: who is to blame by the code's range: ``"MalformedBytes"``,
            ``"PeerBrokeRule"``, ``"LocalResource"``, ``"Application"`` or None.
        tensor: the tensor it concerns, if one.
        sent: for a failed ``send``, what it sent before and beside the failure (each a
            ``SendResult``, acknowledged by the receiver).
        failures: for a failed ``send``, every tensor's failure, this one first.
    """

    def __init__(
        self,
        message: str,
        code: Optional[int] = None,
        code_name: Optional[str] = None,
        blame: Optional[str] = None,
        tensor: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.code_name = code_name
        self.blame = blame
        self.tensor = tensor
        self.sent: List[Any] = []
        self.failures: List["TensorwireError"] = []
