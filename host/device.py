"""The host driver: one ``Device`` over any transport (``hbfp.host.open(spec)``).

``Device.gemm`` computes ``act(op(A) @ op(B) + C + bias)`` on the device, bit for bit as
``hbfp.golden.gemm.gemm`` on the whole problem (``reference_gemm`` is that comparison): it
quantizes on the host (``input="codes"``) or lets the device quantize (``"fp32"``,
``"bf16"``), tiles products larger than the device's buffers, and keeps the contract's
K-tile order by chaining K chunks onto the accumulator (docs/host.md). On a reduced device
(IDENTIFY's ``omitted`` units, activation units not built) it quantizes and applies
activations on the host where the device cannot, so the results stay the same bit for bit.

Requests are pipelined where the link has flow control (TCP, the simulator): the next
block's operands are sent before the previous block's reply is awaited, so they travel
while the device computes and answers. Over a serial port (no flow control: the board's
receive FIFO would overflow) the next heavy request waits for the previous reply. Every request is retried on a bad CRC (either way), a lost or truncated frame
or a timeout, with a new tag; replies with other tags are stale and ignored. A failure in
the middle of a K chain restarts the chain (the accumulator's contents are then unknown).
"""

from __future__ import annotations

import functools
import operator
import os
import random
import time
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Set
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from hbfp.golden import bf16
from hbfp.golden.bfp import BFPTensor, Format, quantize
from hbfp.golden.gemm import epilogue as golden_epilogue
from hbfp.golden.gemm import gemm as golden_gemm
from hbfp.contract import FUNCTIONS, UNARY_FUNCTIONS, frame_size
from hbfp.golden.activations import evaluate

from . import planner
from . import protocol as P
from .errors import (
    AbiMismatch,
    CrcError,
    DeviceError,
    NotSupported,
    ProtocolError,
    ShapeMismatch,
    Timeout,
    TooLarge,
)
from .protocol import Op, OutFormat, Status

__all__ = ["Device", "Stats", "reference_gemm", "INPUTS", "OUTPUTS", "memory_limit", "set_memory_limit",
           "check_product_size"]

#: How operands travel: quantized on the host (codes and exponents), or as values that
#: the device quantizes.
INPUTS = ("codes", "fp32", "bf16")
OUTPUTS = ("fp32", "bf16", "bfp")


@dataclass
class Stats:
    """Counters of a ``Device`` (``Device.stats``; ``Device.reset_stats()`` zeroes them).

    ``bytes_sent``/``bytes_received``: every byte on the link, frames and retries included;
    ``cycles``: device cycles reported by completed GEMM and READ commands; ``macs``:
    ``M * N * K`` of the completed GEMM commands; ``retries``: requests or K chains sent
    again; ``stale_replies``: replies ignored (old tags, duplicates, damaged frames);
    ``host_quantized``: operands or outputs quantized on the host because the device's
    quantizer could not reproduce the whole-matrix stochastic stream, or because the device
    was built without that quantizer or its stochastic rounding (a reduced device;
    docs/host.md), or because an activation applied on the host comes before it;
    ``host_activations``: products (``gemm``) and elementwise calls (``activation``,
    ``gradient``) whose activation or gradient the host applied because the device was
    built without that unit."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    commands: int = 0
    cycles: int = 0
    macs: int = 0
    retries: int = 0
    stale_replies: int = 0
    host_quantized: int = 0
    host_activations: int = 0

    @property
    def link_bytes(self) -> int:
        return self.bytes_sent + self.bytes_received

    @property
    def bytes_per_mac(self) -> float:
        return self.link_bytes / self.macs if self.macs else float("nan")

    def copy(self) -> "Stats":
        return Stats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: "Stats") -> "Stats":
        return Stats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


@dataclass
class _Cmd:
    op: Op
    payload: bytes
    #: Occupies the device (GEMM, READ, ELEMENTWISE): the pipeline's window counts these.
    heavy: bool = False
    #: A GEMM onto the accumulator: running it twice changes the result.
    accumulate: bool = False
    on_reply: Callable[[bytes], None] | None = None


class _Retry(Exception):
    """A failure after which the request (or its K chain) may be sent again."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


# ---- operands --------------------------------------------------------------------------


#: What an operand may be (``_as_array``'s TypeError says it).
_ACCEPTED = "a NumPy array, a nested list of numbers, a BFPTensor or a __dlpack__ tensor"


def _as_array(x, what: str):
    """numpy arrays and BFPTensors as they are; any ``__dlpack__`` producer through
    ``hbfp.host.dlpack`` (zero-copy, bfloat16 included); numbers and (nested, rectangular)
    sequences of numbers through ``np.asarray``. Anything else (None, a str, a mapping, a set,
    an iterator or generator, a ragged list, objects) is a ``TypeError`` naming ``what``."""
    if isinstance(x, (np.ndarray, BFPTensor)):
        return x
    if hasattr(x, "__dlpack__"):
        from . import dlpack

        try:
            return dlpack.to_numpy(x, what)
        except BufferError as e:  # the producer cannot export (e.g. NumPy's ml_dtypes.bfloat16)
            raise NotSupported(f"{what}: cannot import the tensor through DLPack ({e})") from e
    if x is None or isinstance(x, (str, bytes, bytearray, Mapping, Set, Iterator)):
        kind = "None" if x is None else ("a generator" if isinstance(x, Generator) else f"a {type(x).__name__}")
        raise TypeError(f"{what} must be {_ACCEPTED}, got {kind}")
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nesting: NumPy's "inhomogeneous shape"
        raise TypeError(f"{what} must be {_ACCEPTED}; got a {type(x).__name__} that is not a rectangular "
                        f"array of numbers ({e})") from None
    if arr.dtype == object:
        raise TypeError(f"{what} must be {_ACCEPTED}; got a {type(x).__name__} that NumPy holds as Python "
                        "objects (not numbers of one type)")
    return arr


def _check_float(x: np.ndarray, what: str) -> None:
    if x.dtype.name != "bfloat16" and x.dtype.kind not in "fiu":
        raise TypeError(f"{what} must hold fp32 or bf16 values (or any float/int), got dtype {x.dtype}")


_memory_limit: int | None = None


@functools.cache
def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def memory_limit() -> int | None:
    """The most bytes a product's operands (as codes) and result may take
    (``check_product_size``): ``set_memory_limit``'s, else ``$HBFP_MEMORY_LIMIT`` (bytes), else a
    quarter of the machine's physical memory (None: no limit known)."""
    if _memory_limit is not None:
        return _memory_limit
    env = os.environ.get("HBFP_MEMORY_LIMIT")
    if env:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"HBFP_MEMORY_LIMIT must be a number of bytes, got {env!r}") from None
    total = _physical_memory()
    return None if total is None else total // 4


def set_memory_limit(limit: int | None) -> None:
    """Set ``memory_limit`` (bytes; None: back to the default)."""
    global _memory_limit
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"the memory limit must be a positive number of bytes or None, got {limit!r}")
    _memory_limit = limit


def check_product_size(m: int, n: int, k: int, batch: int = 1, code_bytes: int = 1) -> None:
    """Refuse (``TooLarge``) a product of ``batch`` m x k by k x n matrices whose operands'
    codes and fp32 result would take more than ``memory_limit`` bytes."""
    limit = memory_limit()
    need = batch * (4 * m * n + code_bytes * (m * k + k * n))
    if limit is not None and need > limit:
        raise TooLarge(f"a product of {batch} x {m}x{k} @ {k}x{n} needs about {need / 2**30:.1f} GiB for its codes and "
                       f"result, over the limit of {limit / 2**30:.1f} GiB (hbfp.host.set_memory_limit, "
                       "$HBFP_MEMORY_LIMIT)")


def _fp32(x, what: str) -> np.ndarray:
    """``bias`` or ``c`` as fp32 (real numbers only: a complex one would lose its imaginary
    part, a BFPTensor is not values)."""
    arr = _as_array(x, what)
    if isinstance(arr, BFPTensor):
        raise TypeError(f"{what} must be fp32 values, not a BFPTensor")
    _check_float(arr, what)
    return np.asarray(arr, dtype=np.float32)


def _values(x: np.ndarray, input: str) -> np.ndarray:
    """An operand as it travels for ``input``: the array itself for ``"codes"`` (quantized
    on the host as ``hbfp.golden.bfp.quantize`` reads it), float32 for ``"fp32"`` (bf16
    widened exactly, other types rounded by NumPy), bf16 patterns (``uint16``) for ``"bf16"``
    (fp32 rounded by ``bf16.from_f32``)."""
    if input == "codes":
        return x
    is_bf16 = x.dtype.name == "bfloat16"
    if input == "fp32":
        return bf16.to_f32(bf16.as_bits(x)) if is_bf16 else x.astype(np.float32)
    return bf16.as_bits(x).copy() if is_bf16 else bf16.from_f32(x.astype(np.float32))


def _quantize_values(v: np.ndarray, input: str, fmt: Format, seed: int) -> BFPTensor:
    """What the device's quantizer makes of values sent with ``input``."""
    return quantize(bf16.to_dtype(v) if input == "bf16" else v, fmt, seed=seed)


def _seed_int(s, seed) -> int:
    """An integer seed (a Python or NumPy integer, not a bool or a float): a TypeError otherwise."""
    if not isinstance(s, bool):
        try:
            return operator.index(s)
        except TypeError:
            pass
    raise TypeError(f"seed must be an integer or three integers (A, B, output), got {seed!r} "
                    f"({type(s).__name__}{' in it' if s is not seed else ''})")


def _seeds(seed, rounding: str) -> tuple[int, int, int]:
    """Seeds of A, B and a BFP output: ``seed`` gives (seed, seed + 1, seed + 2)."""
    if seed is None:
        if rounding == "stochastic":
            raise ValueError("stochastic rounding needs a seed (gemm(..., seed=N)) to be reproducible")
        return (0, 0, 0)
    if isinstance(seed, (tuple, list)):
        if len(seed) != 3:
            raise ValueError(f"seed must be an integer or three (A, B, output), got {seed!r}")
        return tuple(_seed_int(s, seed) & 0xFFFFFFFF for s in seed)
    s = _seed_int(seed, seed)
    return (s & 0xFFFFFFFF, (s + 1) & 0xFFFFFFFF, (s + 2) & 0xFFFFFFFF)


def stack_codes(x, fmt: Format, seed: int = 0):
    """A stack of matrices (B x R x C torch tensor) quantized as one matrix in ``fmt``: each
    padded with zeros to whole tiles, so that no tile spans two of them, and stacked
    (``hbfp.kernels.quantize`` of a stack). Returns codes B x R x C and exponents
    B x (tile rows) x (tile columns); to nearest, the codes of each matrix equal its own
    quantization's."""
    from hbfp import kernels

    return kernels.quantize(x, fmt, seed=seed)


def _empty_bfp(rows: int, cols: int, fmt: Format) -> BFPTensor:
    th, tw = fmt.tile
    return BFPTensor(np.zeros((rows, cols), fmt.code_dtype), np.zeros((-(-rows // th), -(-cols // tw)), np.uint8), fmt)


def _empty_result(m: int, n: int, out: str, fmt: Format):
    if out == "fp32":
        return np.zeros((m, n), np.float32)
    if out == "bf16":
        return bf16.to_dtype(np.zeros((m, n), np.uint16))
    return _empty_bfp(m, n, fmt)


def _prepare(a, b, *, bias, c, transpose_a, transpose_b, input, fmt: Format, what=("a", "b")):
    """Validate and convert the operands: (A, B, bias, c, M, K, N), where A and B are
    BFPTensors (input "codes") or value arrays (input "fp32"/"bf16")."""
    if input not in INPUTS:
        raise ValueError(f"input must be one of {INPUTS}, got {input!r}")
    ops = []
    for x, name in zip((a, b), what, strict=True):
        x = _as_array(x, name)
        if isinstance(x, BFPTensor):
            if x.codes.ndim != 2:
                raise ShapeMismatch(f"{name} must be a matrix, got shape {x.shape}")
            if x.fmt.mantissa_bits != fmt.mantissa_bits or x.fmt.tile != fmt.tile:
                raise NotSupported(f"{name} is in {x.fmt.mantissa_bits}-bit codes with tile {x.fmt.tile}; "
                                   f"this device stores {fmt.mantissa_bits}-bit codes with tile {fmt.tile}")
        else:
            if x.ndim != 2:
                raise ShapeMismatch(f"{name} must be a matrix (2 axes), got shape {x.shape}")
            _check_float(x, name)
            x = _values(x, input)
        ops.append(x)
    A, B = ops
    M, K = A.shape[::-1] if transpose_a else A.shape
    K2, N = B.shape[::-1] if transpose_b else B.shape
    if K != K2:
        raise ShapeMismatch(
            f"the product does not agree along K: op(A) is {M}x{K}, op(B) is {K2}x{N} "
            f"(a is {A.shape[0]}x{A.shape[1]}{' transposed' if transpose_a else ''}, "
            f"b is {B.shape[0]}x{B.shape[1]}{' transposed' if transpose_b else ''})")
    check_product_size(M, N, K, code_bytes=P.code_bytes(fmt.mantissa_bits))
    if bias is not None:
        bias = _fp32(bias, "bias")
        if bias.shape != (N,):
            raise ShapeMismatch(f"bias must have N = {N} values, got shape {bias.shape}")
    if c is not None:
        c = _fp32(c, "c")
        if c.shape != (M, N):
            raise ShapeMismatch(f"c must have the output's shape {(M, N)}, got {c.shape}")
    return A, B, bias, c, M, K, N


def reference_gemm(fmt: Format, a, b, *, bias=None, activation=None, out="fp32", transpose_a=False,
                   transpose_b=False, c=None, input="codes", rounding="nearest_even", seed=None):
    """What ``Device.gemm`` must return, computed by ``hbfp.golden`` on the whole problem:
    the operands quantized whole in ``fmt`` (the device's format) with ``rounding`` and
    their seeds, then ``hbfp.golden.gemm.gemm``. Same arguments as ``Device.gemm``."""
    fmt = fmt.with_rounding(rounding)
    if out not in OUTPUTS:
        raise ValueError(f"out must be one of {OUTPUTS}, got {out!r}")
    sa, sb, so = _seeds(seed, rounding)
    A, B, bias, c, M, K, N = _prepare(a, b, bias=bias, c=c, transpose_a=transpose_a, transpose_b=transpose_b,
                                      input=input, fmt=fmt)
    if M == 0 or N == 0:
        return _empty_result(M, N, out, fmt)
    qs = []
    for x, s in ((A, sa), (B, sb)):
        if isinstance(x, BFPTensor):
            qs.append(x)
        elif x.size == 0:
            qs.append(_empty_bfp(*x.shape, fmt))
        else:
            qs.append(_quantize_values(x, input, fmt, s))
    return golden_gemm(qs[0], qs[1], c=c, bias=bias, activation=activation, out=fmt if out == "bfp" else out,
                       transpose_a=transpose_a, transpose_b=transpose_b, seed=so)


class _Operand:
    """One operand of a product as the driver sends it: codes and exponents of a host
    quantization (``t``), or values (``v``) that the device quantizes."""

    def __init__(self, name: str, x, input: str, fmt: Format, seed: int, transposed: bool):
        self.name = name
        self.transposed = transposed
        self.seed = seed
        self.input = input
        if isinstance(x, BFPTensor):
            self.t, self.v = x, None
        elif input == "codes":
            self.t, self.v = quantize(x, fmt, seed=seed), None
        else:
            self.t, self.v = None, x
        self.shape = x.shape
        self.fmt = fmt

    @property
    def values(self) -> bool:
        return self.v is not None

    def quantize_on_host(self) -> None:
        self.t = _quantize_values(self.v, self.input, self.fmt, self.seed)
        self.v = None


def _check_identity(ident: P.Identity, name: str) -> None:
    """An IDENTIFY reply the driver can work with: every side positive, the mantissa bits a
    format's, the buffers a whole number of tiles and of array lanes, a payload buffer larger
    than a request's header. ``ProtocolError`` names the field otherwise (a device bug)."""

    def bad(field: str, why: str) -> ProtocolError:
        return ProtocolError(f"{name} reported an identity the driver cannot use: {field} = "
                             f"{getattr(ident, field)} ({why})")

    for field in ("rows", "cols", "tile_rows", "tile_cols", "size", "stream_bytes"):
        if getattr(ident, field) < 1:
            raise bad(field, "must be at least 1")
    if not 2 <= ident.mantissa_bits <= 16:
        raise bad("mantissa_bits", "must be 2..16")
    for field in ("tile_rows", "tile_cols", "rows", "cols"):
        if ident.size % getattr(ident, field):
            raise ProtocolError(f"{name} reported an inconsistent identity: size = {ident.size} is not a multiple of "
                                f"{field} = {getattr(ident, field)}")
    header = max(P.WRITE_HEADER, P.ELEMENTWISE_HEADER)
    if ident.max_payload <= header:
        raise bad("max_payload", f"must exceed a request's {header}-byte header")


# ---- the driver ------------------------------------------------------------------------------


class Device:
    """A device behind a transport. ``hbfp.host.open(spec)`` makes one.

    ``timeout``: seconds to wait for each reply; ``retries``: how many times a request (or
    a K chain) is sent again after a bad CRC, a lost or truncated frame or a timeout, so a
    device that stops answering raises ``Timeout`` after at most
    ``timeout * (retries + 1)`` seconds; ``pipeline``: send the next block before the
    previous reply has arrived (default: where the transport has flow control, i.e. not
    over a UART, whose board-side receive FIFO would overflow). Not thread-safe: one caller
    at a time."""

    def __init__(self, transport, *, timeout: float = 5.0, retries: int = 3, pipeline: bool | None = None,
                 name: str = "", check: bool = True):
        self.transport = transport
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.pipeline = getattr(transport, "flow_control", True) if pipeline is None else bool(pipeline)
        self.name = name or type(transport).__name__
        self.stats = Stats()
        # A random first tag: replies left on the link by an earlier session are stale.
        self._tag = random.randrange(P.FRAME_TIMEOUT_TAG)
        self._parser = P.FrameParser()
        self._frames: deque = deque()
        self._identity: P.Identity | None = None
        self._resident: dict = {}
        self._direct_cycles: dict = {}
        self._tensor_blocks: dict = {}  # count_tensors_product's tilings by shape
        # The executor, chosen here once: the in-process emu (an ``EmuDevice`` without ``wire``)
        # computes each product whole; any other device gets the plan's commands through the
        # session.
        device = getattr(transport, "device", None)
        self._direct = device if getattr(device, "direct", False) else None
        #: Whether products run in this process (``gemm_tensors`` and ``bmm_tensors`` then take
        #: torch tensors where they are), not through a link.
        self.in_process = self._direct is not None
        self._execute = self._gemm_in_process if self.in_process else self._gemm_over_link
        if check:
            self.info()

    def _count_direct(self, M: int, N: int, K: int, blocks, final: OutFormat) -> None:
        """Counts the cycles and MACs of the GEMM commands a product tiled as ``blocks``
        (``planner.blocks``) would send, for a product computed in-process (``in_process``); the
        cycles of a shape are worked out once (a training step repeats its shapes)."""
        bm, bn, bk, nI, nJ, nP = blocks
        if K == 0:
            return
        key = (M, N, K, blocks, final)
        cycles = self._direct_cycles.get(key)
        if cycles is None:
            cycles = 0

            def sides(total: int, side: int, count: int) -> list[tuple[int, int]]:
                # (side, how many blocks have it): the full blocks, then the last one
                last = total - (count - 1) * side
                return [(side, count - 1), (last, 1)] if count > 1 else [(last, 1)]

            last_k = K - (nP - 1) * bk
            for mi, ci in sides(M, bm, nI):
                for nj, cj in sides(N, bn, nJ):
                    # Every block: nP - 1 chunks of bk whose replies are discarded, then the last.
                    c = self._direct.product_cycles(mi, nj, last_k)
                    if nP > 1:
                        c += (nP - 1) * self._direct.product_cycles(mi, nj, bk)
                    cycles += ci * cj * c
            if len(self._direct_cycles) > 4096:
                self._direct_cycles.clear()
            self._direct_cycles[key] = cycles
        self.stats.cycles += cycles
        self.stats.macs += M * N * K

    def count_tensors_product(self, M: int, N: int, K: int, transpose_a: bool = False, transpose_b: bool = False,
                              final: OutFormat = OutFormat.FP32) -> None:
        """Counts the cycles and MACs of an M x K by K x N product that ``gemm_tensors`` (or a
        caller of the registry that stands for it: ``hbfp.torch.compiled``) computed in process."""
        key = (M, N, K, transpose_a, transpose_b)
        blocks = self._tensor_blocks.get(key)
        if blocks is None:  # (a training step repeats its shapes)
            blocks = planner.blocks(self.identity, M, N, K, transpose_a, transpose_b, False, self.name)
            if len(self._tensor_blocks) > 4096:
                self._tensor_blocks.clear()
            self._tensor_blocks[key] = blocks
        self._count_direct(M, N, K, blocks, final)

    def gemm_tensors(self, a, b, *, bias=None, activation: str | None = None, out: str = "fp32",
                     transpose_a: bool = False, transpose_b: bool = False, c=None, rounding: str = "nearest_even",
                     seed=None):
        """``gemm`` of torch tensors on an in-process device (``in_process``), computed where
        the tensors are (CPU or CUDA) by the registry ``hbfp.kernels``, equal bit for bit to
        ``gemm`` with ``input="codes"``: a float32 tensor (``out="fp32"``) or a bfloat16 one
        (``"bf16"``). ``a``, ``b``: float tensors (quantized here in the device's format, with
        ``rounding`` and the seeds as ``gemm`` gives them) or ``(codes, exponents)`` pairs in
        the device's format (e.g. ``hbfp.kernels.quantize``'s), of the stored matrices.
        ``bias`` (N) and ``c`` (M x N): float tensors. Counts cycles and MACs as ``gemm`` does."""
        import torch

        from hbfp import kernels

        if not self.in_process:
            raise NotSupported(f"{self.name} computes products through its link: use gemm")
        if out not in ("fp32", "bf16"):
            raise ValueError(f"gemm_tensors returns fp32 or bf16, not {out!r}")
        ident = self.identity
        fmt = ident.fmt(rounding)
        sa, sb, _ = _seeds(seed, rounding)
        shapes = [tuple((x[0] if isinstance(x, tuple) else x).shape) for x in (a, b)]
        if all(len(sh) == 2 for sh in shapes):  # (else refused below)
            (m, k), (_, n) = (sh[::-1] if t else sh for sh, t in zip(shapes, (transpose_a, transpose_b)))
            check_product_size(m, n, k, code_bytes=P.code_bytes(ident.mantissa_bits))
        stored = []
        for x, s, name in ((a, sa, "a"), (b, sb, "b")):
            if isinstance(x, tuple):
                codes, expo = x
            else:
                if not isinstance(x, torch.Tensor) or x.dim() != 2:
                    raise ShapeMismatch(f"{name} must be a matrix tensor or (codes, exponents), got {type(x).__name__}")
                codes, expo = kernels.quantize(x, fmt, seed=s)
            stored.append((codes, expo))
        (ca, ea), (cb, eb) = stored
        fa = fb = fmt
        if transpose_a:
            ca, ea, fa = ca.t(), ea.t(), fmt.transposed()
        if transpose_b:
            cb, eb, fb = cb.t(), eb.t(), fmt.transposed()
        (M, K), (K2, N) = ca.shape, cb.shape
        if K != K2:
            raise ShapeMismatch(f"the product does not agree along K: op(A) is {M}x{K}, op(B) is {K2}x{N}")
        if not ident.square and K and (transpose_a or not transpose_b):
            raise NotSupported(f"{self.name}'s tile {ident.tile} is not square: A must be stored M x K and B N x K")
        final = planner.OUT_CODES[out]
        if activation is not None:
            if activation not in UNARY_FUNCTIONS:
                raise ValueError(f"unknown activation {activation!r}; known: {', '.join(UNARY_FUNCTIONS)}")
            if self._function(activation) is None:
                self.stats.host_activations += 1
                final = OutFormat.BF16
        if M and N:
            self.count_tensors_product(M, N, K, transpose_a, transpose_b, final)
        f32 = (lambda t: None if t is None else t.detach().to(torch.float32))
        return kernels.gemm((ca, ea), (cb, eb), fa=fa, fb=fb, c=f32(c), bias=f32(bias), activation=activation,
                            out=out, leaky_shift=ident.leaky_shift)

    def bmm_tensors(self, a, b, *, rounding: str = "nearest_even", seed=None):
        """The stack of products ``a[i] @ b[i]`` (``a`` B x M x K, ``b`` B x K x N float
        tensors, or stacks' ``(codes, exponents)`` as ``stack_codes`` gives them) on an
        in-process device, counted as that many products.

        With square tiles each stack is quantized as one matrix, its matrices padded to whole
        tiles (so that no tile spans two of them; ``stack_codes``): to nearest, each product
        equals ``gemm_tensors(a[i], b[i])`` bit for bit; with ``rounding`` "stochastic" the
        stacks take the seeds ``gemm``'s ``seed`` gives A and B. The products then run at once
        (one call of the registry's ``gemm`` on the stacks). With blocks along K only
        (MXINT8's), product by product: ``gemm_tensors(a[i], b[i]^T, transpose_b=True,
        rounding, seed)``."""
        import torch

        from hbfp import kernels

        if not self.in_process:
            raise NotSupported(f"{self.name} computes products through its link: use gemm")
        sa_, sb_ = (x[0] if isinstance(x, tuple) else x for x in (a, b))
        if sa_.dim() != 3 or sb_.dim() != 3 or sa_.shape[0] != sb_.shape[0] or sa_.shape[2] != sb_.shape[1]:
            raise ShapeMismatch(f"bmm_tensors takes B x M x K and B x K x N stacks, got {tuple(sa_.shape)} and "
                                f"{tuple(sb_.shape)}")
        (nb, m, k), n = sa_.shape, sb_.shape[2]
        check_product_size(m, n, k, nb, P.code_bytes(self.identity.mantissa_bits))
        ident = self.identity
        if nb == 0 or not (m and n and k):
            return torch.zeros(nb, m, n, dtype=torch.float32)
        if not ident.square:  # blocks along K: B stored N x K
            return torch.stack([self.gemm_tensors(a[i], b[i].t(), transpose_b=True, rounding=rounding, seed=seed)
                                for i in range(nb)])
        fmt = ident.fmt(rounding)
        sa, sb, _ = _seeds(seed, rounding)
        a3 = a if isinstance(a, tuple) else stack_codes(a, fmt, sa)
        b3 = b if isinstance(b, tuple) else stack_codes(b, fmt, sb)
        before = (self.stats.cycles, self.stats.macs)
        self._count_direct(m, n, k, planner.blocks(ident, m, n, k, False, False, False, self.name),
                           OutFormat.FP32)
        self.stats.cycles += (nb - 1) * (self.stats.cycles - before[0])
        self.stats.macs += (nb - 1) * (self.stats.macs - before[1])
        return kernels.gemm(a3, b3, fa=fmt, fb=fmt)

    # ---- plumbing ----------------------------------------------------------------------

    def _send(self, cmd: _Cmd) -> int:
        tag = self._tag
        self._tag = (self._tag + 1) % P.FRAME_TIMEOUT_TAG  # 0xFFFF is the TIMEOUT reply's
        frame = P.encode_frame(cmd.op, tag, cmd.payload)
        self.transport.send(frame)
        self.stats.bytes_sent += len(frame)
        self.stats.frames_sent += 1
        return tag

    def _await(self, tag: int, cmd: _Cmd, accumulated: set) -> bytes:
        """The data of the reply to ``tag``; ``_Retry`` when it may be sent again."""
        # The timeout counts silence: a long reply on a slow link keeps it alive.
        deadline = time.monotonic() + self.timeout
        waited = False
        while True:
            while self._frames:
                item = self._frames.popleft()
                if isinstance(item, tuple):  # a reply damaged on the way back
                    _, _, t = item
                    if t == tag:
                        raise _Retry(CrcError(f"the reply to {cmd.op.name} failed its CRC"))
                    self.stats.stale_replies += 1
                    continue
                self.stats.frames_received += 1
                status = item.payload[0] if item.payload else None
                if item.tag == P.FRAME_TIMEOUT_TAG and status == Status.TIMEOUT:
                    raise _Retry(Timeout(f"the device dropped a truncated frame while {cmd.op.name} was pending"))
                if item.tag != tag or not item.is_reply or (item.opcode & ~P.REPLY != cmd.op and status != Status.BAD_CRC):
                    if item.tag in accumulated and status == Status.OK:
                        # A duplicated frame ran a product onto the accumulator twice.
                        raise _Retry(CrcError("the device ran an accumulating product twice (a duplicated frame)"))
                    self.stats.stale_replies += 1
                    continue
                if status is None or status not in Status._value2member_map_:
                    raise ProtocolError(f"reply to {cmd.op.name} has no valid status byte: {item.payload[:1]!r}")
                if status == Status.OK:
                    return item.payload[1:]
                if status == Status.BAD_CRC:
                    raise _Retry(CrcError(f"the device received {cmd.op.name} with a bad CRC"))
                if status == Status.TIMEOUT:
                    raise _Retry(Timeout(f"the device timed out receiving {cmd.op.name}"))
                err = DeviceError(status, f"{self.name}: {cmd.op.name} refused: {Status(status).name}"
                                          f"{_STATUS_HINTS.get(status, '')}")
                if status == Status.BAD_LENGTH:
                    raise _Retry(err)  # also what a corrupted length field gives
                raise err
            if waited:
                raise _Retry(Timeout(f"{self.name}: no reply to {cmd.op.name} within {self.timeout:g} s"))
            left = deadline - time.monotonic()
            data = self.transport.receive(left) if left > 0 else b""
            if not data:
                # The transport waited out the timeout: give up any partial reply (its
                # bytes were lost) and look once more at what was buffered behind it.
                waited = True
                self._frames.extend(self._parser.expire())
                continue
            self.stats.bytes_received += len(data)
            self._frames.extend(self._parser.feed(data))
            deadline = time.monotonic() + self.timeout

    def _run(self, chains: list[Callable[[dict], list[_Cmd]]]) -> None:
        """Send the commands of every chain, in order, keeping up to two heavy commands in
        flight (and, over a link with a ``window``, no more request bytes unanswered than it
        says); a retryable failure restarts the chain it happened in (from a blank slate:
        every operand is written again)."""
        depth = 2 if self.pipeline else 1
        window = getattr(self.transport, "window", None)
        outstanding = 0  # request bytes sent and not yet answered
        resident = self._resident
        built: dict[int, list[_Cmd]] = {}
        attempts: dict[int, int] = {}
        inflight: deque = deque()
        heavy = 0
        send_c = send_k = recv_c = 0
        accumulated: set = set()
        try:
            while recv_c < len(chains):
                while send_c < len(chains) and heavy < depth:
                    if send_c not in built:
                        built[send_c] = chains[send_c](resident)
                    cmds = built[send_c]
                    if send_k >= len(cmds):
                        send_c, send_k = send_c + 1, 0
                        continue
                    cmd = cmds[send_k]
                    size = frame_size(len(cmd.payload))
                    if window is not None and inflight and outstanding + size > window:
                        break  # the device's buffer is full until a reply comes
                    inflight.append((self._send(cmd), send_c, send_k, cmd))
                    heavy += cmd.heavy
                    outstanding += size
                    send_k += 1
                tag, c, k, cmd = inflight.popleft()
                heavy -= cmd.heavy
                outstanding -= frame_size(len(cmd.payload))
                try:
                    data = self._await(tag, cmd, accumulated)
                    if cmd.on_reply is not None:
                        cmd.on_reply(data)
                except _Retry as e:
                    attempts[c] = attempts.get(c, 0) + 1
                    if attempts[c] > self.retries:
                        raise e.error from None
                    self.stats.retries += 1
                    inflight.clear()
                    heavy = outstanding = 0
                    resident.clear()
                    accumulated.clear()
                    built = {cc: v for cc, v in built.items() if cc < c}
                    send_c, send_k = c, 0
                    continue
                self.stats.commands += 1
                if cmd.accumulate:
                    accumulated.add(tag)
                if k == len(built[c]) - 1:
                    recv_c = c + 1
                    accumulated.clear()
                    del built[c]
        except BaseException:
            resident.clear()  # requests in flight may still run: the buffers are unknown
            raise

    def command(self, op: int, payload: bytes = b"") -> bytes:
        """Send one request (retried as any other) and return its reply's data."""
        out = []
        self._run([lambda resident: [_Cmd(Op(op), payload, on_reply=out.append)]])
        return out[0]

    # ---- identity, status ------------------------------------------------------------------

    def info(self) -> P.Identity:
        """Ask the device who it is (IDENTIFY). A device whose ABI major differs from the
        host's is refused with ``AbiMismatch``."""
        data = self.command(Op.IDENTIFY)
        if len(data) < 3:
            raise ProtocolError(f"IDENTIFY reply too short ({len(data)} bytes)")
        if data[0] != P.PROTOCOL_VERSION or data[1] != P.ABI_VERSION[0]:
            raise AbiMismatch(
                f"{self.name} speaks protocol {data[0]}, ABI {data[1]}.{data[2]}; this host (hbfp.host) speaks "
                f"protocol {P.PROTOCOL_VERSION}, ABI {P.ABI_VERSION[0]}.{P.ABI_VERSION[1]}. A different major "
                "version is not compatible: update the host package or the device's bitstream/backend")
        if len(data) < P.IDENTITY_SIZE:
            raise ProtocolError(f"IDENTIFY reply has {len(data)} bytes, expected {P.IDENTITY_SIZE}")
        ident = P.decode_identity(data)
        _check_identity(ident, self.name)
        self._identity = ident
        # The longest reply this device sends: a full fp32 result, or an elementwise one.
        longest = max(ident.max_payload, 1 + 4 + 4 * ident.size * ident.size)
        self._parser.max_payload = longest + 64
        return ident

    @property
    def identity(self) -> P.Identity:
        if self._identity is None:
            self.info()
        return self._identity

    def format(self, rounding: str = "nearest_even") -> Format:
        """The device's BFP format with a rounding mode (what ``reference_gemm`` needs)."""
        return self.identity.fmt(rounding)

    def status(self) -> P.DeviceStatus:
        return P.decode_status(self.command(Op.STATUS))

    def reset(self) -> None:
        """RESET: clears the device's counters and last error (buffers become undefined)."""
        self.command(Op.RESET)
        self._resident.clear()

    def reset_stats(self) -> None:
        self.stats = Stats()

    def close(self) -> None:
        self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<hbfp.host.Device {self.name}>"

    # ---- elementwise -------------------------------------------------------------------------

    def _function(self, name: str) -> int | None:
        """The code of function ``name`` on this device, None when it was built without it."""
        if name not in FUNCTIONS:
            raise ValueError(f"unknown function {name!r}; known: {', '.join(FUNCTIONS)}")
        code = FUNCTIONS.index(name)
        return code if self.identity.functions_mask >> code & 1 else None

    @staticmethod
    def _bf16_bits(x, what: str) -> np.ndarray:
        x = _as_array(x, what)
        if isinstance(x, BFPTensor):
            raise TypeError(f"{what} must be bf16 values, not a BFPTensor")
        if x.dtype.name == "bfloat16" or x.dtype == np.uint16:
            return bf16.as_bits(x)
        if x.dtype.kind == "f":
            return bf16.from_f32(x.astype(np.float32))
        raise TypeError(f"{what} must be bf16 (ml_dtypes.bfloat16, or uint16 patterns) or float, got {x.dtype}")

    def _elementwise(self, function: str, x, g=None) -> np.ndarray:
        if function in FUNCTIONS and (g is None) != (function in UNARY_FUNCTIONS):  # before anything is sent
            raise TypeError(f"{function} takes x and g (the upstream gradient), got g=None" if g is None
                            else f"{function} is a function of x alone, got a g")
        code = self._function(function)
        xb = self._bf16_bits(x, "x")
        shape = xb.shape
        xb = np.ascontiguousarray(xb, dtype="<u2").reshape(-1)
        if g is not None:
            gb = self._bf16_bits(g, "g")
            if gb.shape != shape:
                raise ShapeMismatch(f"g must have x's shape {shape}, got {gb.shape}")
            gb = np.ascontiguousarray(gb, dtype="<u2").reshape(-1)
        if code is None:  # no unit for it on this device: the golden model, here
            self.stats.host_activations += 1
            y = evaluate(function, xb.astype(np.uint16), gb.astype(np.uint16) if g is not None else None,
                         leaky_shift=self.identity.leaky_shift)
            return bf16.to_dtype(np.asarray(y, np.uint16).reshape(shape))
        per = max(1, (self.identity.max_payload - P.ELEMENTWISE_HEADER) // (4 if g is not None else 2))
        out = np.empty(xb.size, np.uint16)
        chains = []
        for s in range(0, xb.size, per):
            e = min(xb.size, s + per)
            payload = P.encode_elementwise(code, xb[s:e].tobytes(), gb[s:e].tobytes() if g is not None else b"")

            def store(data, s=s, e=e):
                if len(data) != 2 * (e - s):
                    raise ProtocolError(f"ELEMENTWISE reply has {len(data)} bytes, expected {2 * (e - s)}")
                out[s:e] = np.frombuffer(data, "<u2")

            chains.append(lambda resident, p=payload, f=store: [_Cmd(Op.ELEMENTWISE, p, heavy=True, on_reply=f)])
        self._run(chains)
        return bf16.to_dtype(out.reshape(shape))

    def activation(self, name: str, x) -> np.ndarray:
        """``name(x)`` on the device's bf16 activation unit (``relu``, ``gelu``, ...): bf16
        in (``ml_dtypes.bfloat16`` or uint16 patterns; floats are rounded to bf16 first),
        an ``ml_dtypes.bfloat16`` array of the same shape out. On a device built without
        that unit the host computes it with the golden model, the same bits
        (``stats.host_activations`` counts it)."""
        if not isinstance(name, str) or name not in UNARY_FUNCTIONS:
            raise ValueError(f"unknown activation {name!r}; known: {', '.join(UNARY_FUNCTIONS)}")
        return self._elementwise(name, x)

    def gradient(self, name: str, x, g) -> np.ndarray:
        """``bf16.mul(name'(x), g)``: the activation's derivative at ``x`` times the upstream
        gradient ``g``, on the device (bf16 in and out, as ``activation``; on the host
        without the device's ``<name>_grad`` unit, as ``activation``)."""
        if not isinstance(name, str) or name not in UNARY_FUNCTIONS or name + "_grad" not in FUNCTIONS:
            raise ValueError(f"no gradient unit for {name!r}; known: "
                             f"{', '.join(f[: -len('_grad')] for f in FUNCTIONS if f.endswith('_grad'))}")
        if g is None:
            raise TypeError(f"gradient({name!r}, x, g) needs g, the upstream gradient (bf16 values of x's shape), "
                            "got None")
        return self._elementwise(name + "_grad", x, g)

    # ---- the product -------------------------------------------------------------------------

    def gemm(self, a, b, *, bias=None, activation: str | None = None, out: str = "fp32", transpose_a: bool = False,
             transpose_b: bool = False, c=None, input: str = "codes", rounding: str = "nearest_even", seed=None):
        """``act(op(A) @ op(B) + C + bias)`` on the device, equal bit for bit to
        ``reference_gemm`` (``hbfp.golden`` on the whole problem).

        ``a``, ``b``: the stored operands (A is M x K, or K x M with ``transpose_a``; B is
        K x N, or N x K with ``transpose_b``): NumPy arrays, any ``__dlpack__`` producer
        (fp32), or ``BFPTensor``s in the device's format. ``input``: ``"codes"`` quantizes
        on the host and sends codes and exponents; ``"fp32"``/``"bf16"`` send values that
        the device quantizes (fp32 data is rounded to bf16 first for ``"bf16"``).
        ``rounding``/``seed``: of every quantization the call makes (operands from values,
        a BFP output); an integer seed gives A ``seed``, B ``seed + 1`` and the output
        ``seed + 2``, or pass three. ``bias`` (N values) and ``c`` (M x N) are fp32.
        ``out``: ``"fp32"`` (float32 array), ``"bf16"`` (ml_dtypes.bfloat16 array) or
        ``"bfp"`` (a BFPTensor in the device's format).

        On a reduced device, what it lacks is done on the host with the golden model (same
        result; ``stats.host_quantized`` counts it): values are quantized on the host without
        the device's value quantizer, a BFP output from the fp32 result without its output
        quantizer, and either when stochastic rounding is asked of a device without it.
        Without a unit for ``activation``, the device sends ``op(A) @ op(B) + C + bias``
        rounded to bf16 (all the activation reads) and the host applies the activation and
        the output format (``hbfp.golden.gemm.epilogue``; ``stats.host_activations`` counts
        it, and ``stats.host_quantized`` a BFP output)."""
        ident = self.identity
        if out not in OUTPUTS:
            raise ValueError(f"out must be one of {OUTPUTS}, got {out!r}")
        fmt = ident.fmt(rounding)  # validates the rounding
        act = P.NO_ACTIVATION
        if activation is not None:
            if activation not in UNARY_FUNCTIONS:
                raise ValueError(f"unknown activation {activation!r}; known: {', '.join(UNARY_FUNCTIONS)}")
            act = self._function(activation)  # None: no unit for it, the host applies it
        sa, sb, so = _seeds(seed, rounding)
        A, B, bias, c, M, K, N = _prepare(a, b, bias=bias, c=c, transpose_a=transpose_a, transpose_b=transpose_b,
                                          input=input, fmt=fmt)
        if not ident.square and K and (transpose_a or not transpose_b):
            raise NotSupported(
                f"{self.name}'s tile {ident.tile} is not square: it blocks both operands along K, so A must be "
                "stored M x K (transpose_a=False) and B stored N x K (transpose_b=True)")
        if M == 0 or N == 0:
            return _empty_result(M, N, out, fmt)
        opA = _Operand("a", A, input, fmt, sa, transpose_a)
        opB = _Operand("b", B, input, fmt, sb, transpose_b)
        plan = planner.plan_gemm(ident, M, N, K, transpose_a=transpose_a, transpose_b=transpose_b, out=out, act=act,
                                 rounding=rounding, out_seed=so, input=input, a_values=opA.values, b_values=opB.values,
                                 a_shape=opA.shape, b_shape=opB.shape, name=self.name)
        for op, on_host in ((opA, plan.host_a), (opB, plan.host_b)):
            if on_host:
                op.quantize_on_host()
                self.stats.host_quantized += 1
        self.stats.host_activations += plan.host_act
        self.stats.host_quantized += plan.host_out
        return self._execute(plan, opA, opB, c, bias, activation, fmt, out, so)

    # ---- the two executors (one chosen at construction: ``in_process``) ---------------------

    def _gemm_over_link(self, plan: planner.Plan, opA: _Operand, opB: _Operand, c, bias,
                        activation: str | None, fmt: Format, out: str, seed: int):
        """The product through the device's commands (``_gemm_commands``), finished on the host
        where the plan says the device cannot."""
        result = self._gemm_commands(plan, opA, opB, c, bias, fmt)
        if plan.host_act or plan.host_out:
            # What the device left out, as golden.gemm.gemm ends on the whole matrix (the
            # output's stochastic stream included). A bf16 result widens to fp32 exactly, and
            # the epilogue's rounding to bf16 gives back the same patterns.
            sums = bf16.to_f32(result) if plan.final == OutFormat.BF16 else result
            return golden_epilogue(sums, activation if plan.host_act else None, fmt if out == "bfp" else out, seed,
                                   leaky_shift=self.identity.leaky_shift)
        if plan.final == OutFormat.BF16:
            return bf16.to_dtype(result)
        return result

    def _gemm_in_process(self, plan: planner.Plan, opA: _Operand, opB: _Operand, c, bias,
                         activation: str | None, fmt: Format, out: str, seed: int):
        """The product on the in-process emu: whole here, as its commands would return it (K
        chunks keep their order on the accumulator; BFP blocks are whole tiles, and a
        stochastic stream that a block would restart was quantized whole by the plan), and the
        cycles those commands would report (a READ's reply, with K = 0, reports none)."""
        self._count_direct(plan.M, plan.N, plan.K, plan.blocks, plan.final)
        ops = []
        for op in (opA, opB):
            if plan.K == 0:
                ops.append(_empty_bfp(*op.shape, op.fmt))
                continue
            if op.values:
                op.quantize_on_host()  # what the device's quantizer makes of them
            ops.append(op.t)
        acc = golden_gemm(ops[0], ops[1], c=c, bias=bias, transpose_a=plan.transpose_a, transpose_b=plan.transpose_b)
        return golden_epilogue(acc, activation, fmt if out == "bfp" else out, seed, leaky_shift=self.identity.leaky_shift)

    def _gemm_commands(self, plan: planner.Plan, opA: _Operand, opB: _Operand, c, bias, fmt: Format):
        """The product through the device's commands (``planner.chain`` for each block, in the
        plan's order, through the session): the result as the device sent it (``plan.final``:
        fp32, bf16 patterns or a BFPTensor)."""
        ident = self.identity
        th, tw = ident.tile
        M, N, final = plan.M, plan.N, plan.final
        if final == OutFormat.FP32:
            result = np.empty((M, N), np.float32)
        elif final == OutFormat.BF16:
            result = np.empty((M, N), np.uint16)
        else:
            result = _empty_bfp(M, N, fmt)

        def store(data: bytes, m0: int, m1: int, n0: int, n1: int, k: int) -> None:
            try:
                cycles, r = P.decode_result(data, m1 - m0, n1 - n0, final, fmt, cycles=k > 0)
            except ValueError as e:
                raise ProtocolError(f"{self.name}: {e}") from None
            self.stats.cycles += cycles or 0
            self.stats.macs += (m1 - m0) * (n1 - n0) * k
            if final == OutFormat.BFP:
                result.codes[m0:m1, n0:n1] = r.codes
                result.exponents[m0 // th : -(-m1 // th), n0 // tw : -(-n1 // tw)] = r.exponents
            elif final == OutFormat.BF16:
                result[m0:m1, n0:n1] = r.view(np.uint16)
            else:
                result[m0:m1, n0:n1] = r

        def partial(data: bytes, m: int, n: int, k: int) -> None:
            self.stats.cycles += P.decode_cycles(data)
            self.stats.macs += m * n * k

        def command(step: planner.Step) -> _Cmd:
            on_reply = None
            if step.reply is not None:
                kind, *where = step.reply
                on_reply = (lambda d, w=where: store(d, *w)) if kind == "result" else (lambda d, w=where: partial(d, *w))
            return _Cmd(step.op, step.payload, heavy=step.heavy, accumulate=step.accumulate, on_reply=on_reply)

        def chain(i: int, j: int, resident: dict) -> list[_Cmd]:
            return [command(step) for step in planner.chain(plan, ident, i, j, resident, opA, opB, c, bias, self.name)]

        self._resident.clear()  # a new product: nothing of the last one is reused
        self._run([lambda resident, i=i, j=j: chain(i, j, resident) for i, j in plan.order])
        return result

_STATUS_HINTS = {
    Status.BAD_ADDRESS: " (a buffer region outside the buffers or not aligned)",
    Status.BAD_DESCRIPTOR: " (a product or operation this device cannot run)",
    Status.BAD_OPCODE: " (the device does not know this command)",
    Status.BAD_VERSION: " (the device speaks another protocol version)",
}
