"""The exceptions tensorwire calls raise: :class:`TensorwireError`, carrying the wire code
(spec §9), and its kinds: a receiver with nothing to give, and (from ``tensorwire_ipc``) a
sharing producer's refusal, :class:`ShareError`."""

from tensorwire_ipc._errors import TensorwireError
from tensorwire_ipc import ShareError

__all__ = ["TensorwireError", "ReceiveTimeout", "ReceiverClosed", "ShareError"]


class ReceiveTimeout(TensorwireError, TimeoutError):
    """No tensor landed within the time given."""


class ReceiverClosed(TensorwireError, EOFError):
    """The receiver is closed: no tensor will land any more."""
