"""The exception every tensorwire call raises, carrying the wire code (spec §9)."""

from typing import Optional


class TensorwireError(Exception):
    """A tensorwire operation failed.

    Attributes:
        code: the wire error code (spec §9.2), or None where the failure had none (a
            connection that could not be made, a bad certificate).
        code_name: the code's registered name, e.g. ``"TENSOR_TOO_LARGE"``.
        blame: who is to blame by the code's range: ``"MalformedBytes"``,
            ``"PeerBrokeRule"``, ``"LocalResource"``, ``"Application"`` or None.
        tensor: the tensor it concerns, if one.
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
