"""The forward operands of the ATen-level products, remembered for their backward products.

A training step quantizes each forward operand once: a weight that an RNN multiplies at every
time step, or the activation that a backward product multiplies again, is the same tensor (the
same memory, not written since) each time. ``ForwardOperands`` keeps, per such tensor, what its
forward products read: its codes on an in-process device (quantized once, not once per time
step), or only the fact on a device that quantizes operands itself. A backward product asks it
about each operand: a forward operand is read as in the forward products (to nearest, as
``HbfpMatmul`` reuses its forward codes); anything else (the output gradient) is quantized by
the recipe's backward configuration.

Tensors are recognized by their memory: the storage's address, the offset, the sizes and
strides (a transposed view is the same tensor: square tiles transpose with it), and torch's
version counter, which every in-place write advances. An entry holds the tensor itself, so its
memory cannot be freed and reused by another tensor while the entry lives; entries go oldest
first beyond ``MAX_ENTRIES`` or ``MAX_BYTES`` of tensors held, and all of them when the
``offload`` context ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

__all__ = ["ForwardOperands"]

MAX_ENTRIES = 4096
MAX_BYTES = 1 << 30


def _layout(x: torch.Tensor):
    """The sizes and strides of ``x`` (a matrix, or a stack of them along the first axis) with
    its matrices in a canonical orientation (a transposed view has the layout of what it
    views), and whether ``x`` is the transpose of that form; None for other tensors."""
    if x.dim() not in (2, 3):
        return None
    *lead, r, c = x.shape
    *lead_s, sr, sc = x.stride()
    flipped = sr < sc or (sr == sc and r < c)
    if flipped:
        r, c, sr, sc = c, r, sc, sr
    return (*lead, *lead_s, r, c, sr, sc), flipped


def _key(x: torch.Tensor):
    """The memory ``x`` reads (a matrix, or a stack of them along the first axis), independent
    of a transposition of its matrices; and whether ``x`` is the transpose of that canonical
    form."""
    layout = _layout(x) if type(x) is torch.Tensor else None
    if layout is None or x.is_inference():  # an inference tensor keeps no version: not remembered
        return None, False
    try:
        base = x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a fake tensor)
        return None, False
    return (base, x.storage_offset(), *layout[0], x._version, x.dtype), layout[1]


def _flip(codes):
    return codes[0].transpose(-1, -2), codes[1].transpose(-1, -2)


class ForwardOperands:
    """What the forward products read of their operands, by tensor (see the module)."""

    def __init__(self):
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def remember(self, x: torch.Tensor, codes) -> None:
        """``x`` was a forward operand, read as ``codes`` ((codes, exponents) of ``x``, or None
        where the device quantizes ``x`` itself)."""
        key, flipped = _key(x)
        if key is None:
            return
        if codes is not None and flipped:
            codes = _flip(codes)
        size = x.numel() * x.element_size()
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = (x, codes, size)
            self._bytes += size
            while len(self._entries) > MAX_ENTRIES or self._bytes > MAX_BYTES:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def lookup(self, x: torch.Tensor):
        """(True, codes of ``x`` or None) if ``x`` was a forward operand, else (False, None)."""
        key, flipped = _key(x)
        if key is None:
            return False, None
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return False, None
        codes = entry[1]
        if codes is not None and flipped:
            codes = _flip(codes)
        return True, codes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
