"""The host side: the device driver, the wire protocol, transports and backends.

``hbfp.host.open("emu")`` gives a ``Device`` (``info``, ``gemm``, ``activation``,
``gradient``, ``status``, ``reset``, ``stats``) over any backend of the entry-point group
``hbfp.devices`` (``emu``, ``tcp:HOST:PORT``, ``udp:HOST:PORT``, ``serial:PORT[:BAUD]``, ``sim``); see
docs/host.md and docs/protocol.md.
"""

from . import protocol
from .device import Device, Stats, memory_limit, reference_gemm, set_memory_limit
from .errors import (
    AbiMismatch,
    BackendError,
    CrcError,
    DeviceError,
    HbfpError,
    LinkError,
    NotSupported,
    ProtocolError,
    ShapeMismatch,
    Timeout,
    TooLarge,
)
from .registry import BackendInfo, backends, open, register_backend
from .server import Server, serve
from .transports import LoopbackTransport, SerialTransport, TcpTransport, Transport, UdpTransport

__all__ = [
    "open",
    "backends",
    "register_backend",
    "BackendInfo",
    "Device",
    "Stats",
    "reference_gemm",
    "protocol",
    "Transport",
    "LoopbackTransport",
    "TcpTransport",
    "UdpTransport",
    "SerialTransport",
    "Server",
    "serve",
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
    "memory_limit",
    "set_memory_limit",
]
