"""What ran where under ``hbfp.torch.offload``: per operation, its calls and the MACs of its
matrix products on the device and on the host (``report()``, ``format_report()``).

Every product the device computes is counted under the operation that issued it (the
function ``offload`` routed, e.g. ``linear``, or the ATen operation, e.g. ``aten.bmm``),
forward and backward alike; an operation with products that ran on the host instead (its
operands were not floating point, or no route exists) counts them as host MACs and warns once
(``HbfpFallbackWarning``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass

__all__ = ["OpCount", "HbfpFallbackWarning", "report", "reset_report", "format_report", "fallbacks",
           "reset_fallbacks"]


class HbfpFallbackWarning(UserWarning):
    """An operation with matrix products ran them in fp32 on the host under ``offload``."""


@dataclass
class OpCount:
    """One operation's line of the report: ``calls`` (forward and backward calls of the
    operation itself), ``device_macs`` and ``host_macs`` of its products."""

    calls: int = 0
    device_macs: int = 0
    host_macs: int = 0


_lock = threading.Lock()
_counts: dict[str, OpCount] = {}
_fallback_calls: dict[str, int] = {}
_label = threading.local()


def _line(op: str) -> OpCount:
    line = _counts.get(op)
    if line is None:
        line = _counts[op] = OpCount()
    return line


def count_call(op: str) -> None:
    with _lock:
        _line(op).calls += 1


def count_device(macs: int) -> None:
    """Counts ``macs`` device MACs under the operation being routed (``routing``)."""
    op = getattr(_label, "op", None) or "product"
    with _lock:
        _line(op).device_macs += int(macs)


def count_host(op: str, macs: int, why: str) -> None:
    """An operation whose products ran on the host: counted, and warned about once per name."""
    with _lock:
        line = _line(op)
        line.calls += 1
        line.host_macs += int(macs)
        first = op not in _fallback_calls
        _fallback_calls[op] = _fallback_calls.get(op, 0) + 1
    if first:
        warnings.warn(f"{op} runs its matrix products in fp32 on the host under hbfp.torch.offload ({why}); "
                      "see hbfp.torch.report()", HbfpFallbackWarning, stacklevel=5)


def discard(op: str) -> None:
    """Forget ``op``'s line (work of torch's own that an ``offload`` context routed, counted
    under ``op`` on purpose: ``hbfp.torch.compiled``)."""
    with _lock:
        _counts.pop(op, None)


@contextlib.contextmanager
def routing(op: str):
    """Device products issued in the body are counted under ``op`` (nested: the outermost
    operation keeps them, so a product inside ``linear`` is ``linear``'s)."""
    outer = getattr(_label, "op", None)
    if outer is None:
        _label.op = op
    try:
        yield
    finally:
        if outer is None:
            _label.op = None


def current() -> str | None:
    """The operation whose products are being counted now, if any."""
    return getattr(_label, "op", None)


def report() -> dict[str, OpCount]:
    """Per operation since the last ``reset_report()``: calls, MACs on the device, MACs on the
    host (copies)."""
    with _lock:
        return {op: OpCount(c.calls, c.device_macs, c.host_macs) for op, c in _counts.items()}


def reset_report() -> None:
    """Forget the report and the fallback counts; the next fallback of each operation warns
    again."""
    with _lock:
        _counts.clear()
        _fallback_calls.clear()


def fallbacks() -> dict[str, int]:
    """Calls, per operation, that ran their products on the host since the last reset (each
    warned about once)."""
    with _lock:
        return dict(_fallback_calls)


reset_fallbacks = reset_report


def format_report(counts: dict[str, OpCount] | None = None) -> str:
    """The report as a table, with the share of all MACs that ran on the device."""
    counts = report() if counts is None else counts
    rows = [("operation", "calls", "device MACs", "host MACs")]
    rows += [(op, str(c.calls), f"{c.device_macs:,}", f"{c.host_macs:,}") for op, c in sorted(counts.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    device = sum(c.device_macs for c in counts.values())
    total = device + sum(c.host_macs for c in counts.values())
    share = f"{100 * device / total:.1f}%" if total else "n/a"
    lines.append(f"on the device: {share} of {total:,} MACs")
    return "\n".join(lines)
