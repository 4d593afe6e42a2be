"""The exceptions of the host driver. Every one is an ``HbfpError``; those about the
caller's arguments are also ``ValueError`` or ``TypeError``, those about the link are also
``ConnectionError`` or ``TimeoutError``, so ordinary ``except`` clauses catch them too."""

from __future__ import annotations

from .protocol import Status

__all__ = [
    "HbfpError",
    "ShapeMismatch",
    "NotSupported",
    "AbiMismatch",
    "BackendError",
    "DeviceError",
    "ProtocolError",
    "LinkError",
    "Timeout",
    "CrcError",
    "TooLarge",
]


class HbfpError(Exception):
    """Base of every host driver error."""


class ShapeMismatch(HbfpError, ValueError):
    """Operand shapes that do not make a product (or a bias/C of the wrong shape)."""


class NotSupported(HbfpError, ValueError):
    """Something this device or this driver does not do (an activation unit not built, a
    transpose a non-square tile cannot serve, bf16 over DLPack, ...)."""


class TooLarge(HbfpError, MemoryError):
    """A product whose operands and result would take more memory than the limit
    (``hbfp.host.memory_limit``), refused before anything is allocated."""


class AbiMismatch(HbfpError):
    """The device (or a backend) speaks another major version of the device interface."""


class BackendError(HbfpError):
    """A device spec names no backend, or its backend failed to load or to open."""


class DeviceError(HbfpError):
    """The device answered a request with an error status."""

    def __init__(self, status: Status, message: str = ""):
        self.status = Status(status)
        super().__init__(message or f"device replied {self.status.name}")


class ProtocolError(HbfpError):
    """A reply that passed its CRC but does not fit the protocol (a device bug)."""


class LinkError(HbfpError, ConnectionError):
    """The link failed: no good reply after the retries, or the connection closed."""


class Timeout(LinkError, TimeoutError):
    """No reply within the configured time (after the retries)."""


class CrcError(LinkError):
    """Frames kept failing their CRC (in either direction) after the retries."""
