"""The compiled kernels' C interface, written once: the ABI number, the structs and every
exported function's signature. ``build`` turns this table into the C header the sources
include (``hbfp_abi.h``, so a source that disagrees with it does not compile) and ``native``
into the ctypes declarations it calls them with.
"""

from __future__ import annotations

import ctypes

#: Bumped whenever a signature, a struct or the meaning of an argument changes; a library that
#: reports another number is rebuilt, never called.
ABI = 7

#: C types of the table and their ctypes.
_CTYPES = {
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "unsigned": ctypes.c_uint32,
    "const char *": ctypes.c_char_p,
    "void *": ctypes.c_void_p,
    "const void *": ctypes.c_void_p,
    "float *": ctypes.c_void_p,
    "const float *": ctypes.c_void_p,
    "unsigned char *": ctypes.c_void_p,
    "const unsigned char *": ctypes.c_void_p,
    "const unsigned short *": ctypes.c_void_p,
    "const unsigned *": ctypes.c_void_p,
    "const hbfp_operand *": ctypes.c_void_p,
    "const hbfp_output *": ctypes.c_void_p,
}

#: One stored operand of a product (or a stack of them): codes (int8 or int16) with any
#: strides and a batch stride, in elements; one E8M0 exponent code per tile, with their
#: strides; the tile (rows, cols); the code's fraction bits (value = code * 2**(E - 127 -
#: frac)) and the largest code magnitude it may hold.
OPERAND = (
    ("codes", "const void *"), ("code_bytes", "int"), ("rs", "long"), ("cs", "long"), ("bs", "long"),
    ("exps", "const unsigned char *"), ("ers", "long"), ("ecs", "long"), ("ebs", "long"),
    ("th", "long"), ("tw", "long"), ("frac", "int"), ("qmax", "int"),
)

#: Where a product's results go: ``out`` (fp32, or bf16 patterns when ``out_bf16``), its row
#: and batch strides in elements; ``c`` (fp32, NULL: start from +0) with its strides, which
#: may be ``out`` itself; ``bias`` (N fp32, NULL: none), added after the last K-tile;
#: ``table`` (65,536 bf16 patterns, NULL: none), an activation applied to the bf16 rounding
#: of each sum (docs/numerics.md, section 4).
OUTPUT = (
    ("out", "void *"), ("ldo", "long"), ("bso", "long"), ("out_bf16", "int"),
    ("c", "const float *"), ("ldc", "long"), ("bsc", "long"),
    ("bias", "const float *"), ("table", "const unsigned short *"),
)

#: name: (return type, ((argument, type), ...)). Every function returns 0 or a negative error
#: code (-1: out of memory, -2: bad arguments) unless it says otherwise.
FUNCTIONS = {
    # ABI (above) and the instruction set this build was compiled for ("c", "avx2", ...).
    "hbfp_abi": ("int", ()),
    "hbfp_isa": ("const char *", ()),
    # The CPU's and the OS's features as bits (build.FEATURES), AMX's tile state requested.
    "hbfp_cpu_features": ("unsigned", ()),
    # C = [c +] sum over K-tiles of A @ B [+ bias], [act], for `batch` products of m x k by k x n.
    "hbfp_gemm": ("int", (("a", "const hbfp_operand *"), ("b", "const hbfp_operand *"),
                          ("o", "const hbfp_output *"), ("batch", "long"), ("m", "long"), ("n", "long"),
                          ("k", "long"), ("threads", "int"))),
    # bfp.quantize of `batch` m x n fp32 matrices (row and column strides rs, cs; batch strides
    # xbs, cbs, ebs), stochastic positions as if stacked, each padded to whole tiles.
    "hbfp_quantize": ("int", (("x", "const float *"), ("rs", "long"), ("cs", "long"), ("m", "long"), ("n", "long"),
                              ("th", "long"), ("tw", "long"), ("mbits", "int"), ("rounding", "int"),
                              ("key", "unsigned"), ("codes", "void *"), ("code_bytes", "int"), ("ldq", "long"),
                              ("exps", "unsigned char *"), ("lde", "long"), ("batch", "long"), ("xbs", "long"),
                              ("cbs", "long"), ("ebs", "long"), ("threads", "int"))),
    # BFPTensor.dequantize to fp32 by the device rules.
    "hbfp_dequantize": ("int", (("codes", "const void *"), ("code_bytes", "int"), ("m", "long"), ("n", "long"),
                                ("ldq", "long"), ("exps", "const unsigned char *"), ("lde", "long"),
                                ("th", "long"), ("tw", "long"), ("frac", "int"), ("out", "float *"),
                                ("threads", "int"))),
    # The patches of a convolution as a matrix, and their adjoint (torch's unfold and fold).
    "hbfp_im2col": ("int", (("x", "const float *"), *((d, "long") for d in (
        "n", "c", "h", "w", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "oh", "ow")),
        ("out", "float *"), ("threads", "int"))),
    # col2im's patch matrix at any strides: sp between positions (rows), sc between columns.
    "hbfp_col2im": ("int", (("cols", "const float *"), *((d, "long") for d in (
        "sp", "sc", "n", "c", "h", "w", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "oh", "ow")),
        ("out", "float *"), ("threads", "int"))),
    # out[b] = x[b]^T for a stack of `batch` m x n fp32 matrices (both contiguous).
    "hbfp_transpose": ("int", (("x", "const float *"), ("batch", "long"), ("m", "long"), ("n", "long"),
                               ("out", "float *"), ("threads", "int"))),
    # hbfp_quantize of hbfp_im2col's matrix, without the matrix (codes and exponents contiguous).
    "hbfp_im2col_quantize": ("int", (("x", "const float *"), *((d, "long") for d in (
        "n", "c", "h", "w", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "oh", "ow", "th", "tw")),
        ("mbits", "int"), ("rounding", "int"), ("key", "unsigned"), ("codes", "void *"), ("code_bytes", "int"),
        ("exps", "unsigned char *"), ("threads", "int"))),
    # A convolution's product op(W) @ P^T (W: a, m x k; P^T: b, k x N*OH*OW positions) made a run
    # of `run_images` images at a time, runs side by side on the threads, each into its own
    # buffer, then into `out`: with `fold`, col2im of the run's columns (m = C*KH*KW) onto the
    # images' N x C x H x W gradient; else the run's (m = OUT) planes of the N x OUT x OH*OW
    # output, plus `bias` (OUT values or NULL) in the caller's fp32 environment.
    "hbfp_conv_runs": ("int", (("a", "const hbfp_operand *"), ("b", "const hbfp_operand *"), ("m", "long"),
                               ("k", "long"), ("run_images", "long"), ("bias", "const float *"),
                               *((d, "long") for d in ("n", "c", "h", "w", "kh", "kw", "sh", "sw", "ph", "pw", "dh",
                                                       "dw", "oh", "ow")),
                               ("out", "float *"), ("fold", "int"), ("threads", "int"))),
    # The LSTM cell's elementwise work, forward and backward (src/cell.c), contiguous rows.
    "hbfp_lstm_cell": ("int", (("p", "const float *"), ("xp", "const float *"), ("c_prev", "const float *"),
                               ("rows", "long"), ("hid", "long"), ("acts", "float *"), ("c", "float *"),
                               ("tc", "float *"), ("h", "float *"))),
    "hbfp_lstm_cell_backward": ("int", (("acts", "const float *"), ("c_prev", "const float *"),
                                        ("tc", "const float *"), ("dy", "const float *"), ("dh", "const float *"),
                                        ("dc", "const float *"), ("rows", "long"), ("hid", "long"),
                                        ("dgates", "float *"), ("dc_prev", "float *"))),
    # An LSTM layer's recurrence (src/cell.c): every step's state quantized (mbits, rounding,
    # keys[t]: one per step) and multiplied by w (W_hh^T's codes, hid x 4 hid), then the cell;
    # and backward, the last step first, each step's gate gradient quantized (keys: one per
    # product, in that order) and multiplied by wt (W_hh's codes, 4 hid x hid).
    "hbfp_lstm_steps": ("int", (("w", "const hbfp_operand *"), ("xp", "const float *"), ("h0", "const float *"),
                                ("c0", "const float *"), ("steps", "long"), ("rows", "long"), ("hid", "long"),
                                ("mbits", "int"), ("rounding", "int"), ("keys", "const unsigned *"),
                                ("acts", "float *"), ("c", "float *"), ("tc", "float *"), ("h", "float *"),
                                ("threads", "int"))),
    "hbfp_lstm_steps_backward": ("int", (("wt", "const hbfp_operand *"), ("acts", "const float *"),
                                         ("c0", "const float *"), ("c", "const float *"), ("tc", "const float *"),
                                         ("dy", "const float *"), ("steps", "long"), ("rows", "long"), ("hid", "long"),
                                         ("need_h0", "int"), ("mbits", "int"), ("rounding", "int"),
                                         ("keys", "const unsigned *"), ("dh", "float *"), ("dc", "float *"),
                                         ("dgates", "float *"), ("threads", "int"))),
}


#: The fp32 constants of the LSTM cell's nonlinearities (src/cell.c, and the same operations in
#: torch: hbfp.kernels.torch_ops.lstm_cell), as exact hexadecimal floats: ln 2 in two parts,
#: Cephes' polynomials of exp (EXP0 .. EXP5, highest degree first) and of tanh (TANH0 .. TANH4),
#: exp's clamp and tanh's threshold.
CELL_CONSTANTS = {
    "LOG2E": "0x1.715476p+0", "ROUND": "0x1.8p+23", "LN2_HI": "0x1.63p-1", "LN2_LO": "-0x1.bd0106p-13",
    "EXP0": "0x1.a0d2cep-13", "EXP1": "0x1.6e879cp-10", "EXP2": "0x1.11121p-7", "EXP3": "0x1.555382p-5",
    "EXP4": "0x1.555554p-3", "EXP5": "0x1p-1",
    "TANH0": "-0x1.75e1d4p-8", "TANH1": "0x1.52269cp-6", "TANH2": "-0x1.b83c5ap-5", "TANH3": "0x1.110726p-3",
    "TANH4": "-0x1.555532p-2",
    "EXP_LO": "-0x1.5cp+6", "EXP_HI": "0x1.6p+6",  # exp's argument clamped to [-87, 88]: 2**n normal
    "TANH_SMALL": "0x1.4p-1",                      # |x| below 0.625: tanh's polynomial
}


def header() -> str:
    """The C header of this table."""
    lines = ["/* Generated by hbfp.kernels.capi from its table: do not edit. */", "#pragma once",
             f"#define HBFP_ABI {ABI}", '#define HBFP_EXPORT __attribute__((visibility("default")))']
    lines += [f"#define HBFP_CELL_{k} ({v}f)" for k, v in CELL_CONSTANTS.items()]
    for name, fields in (("hbfp_operand", OPERAND), ("hbfp_output", OUTPUT)):
        lines.append("typedef struct {")
        lines += [f"    {t} {f};" if not t.endswith("*") else f"    {t}{f};" for f, t in fields]
        lines.append(f"}} {name};")
    for name, (ret, args) in FUNCTIONS.items():
        params = ", ".join(f"{t} {a}" if not t.endswith("*") else f"{t}{a}" for a, t in args) or "void"
        sep = "" if ret.endswith("*") else " "
        lines.append(f"HBFP_EXPORT {ret}{sep}{name}({params});")
        if args:
            lines.append(f"HBFP_EXPORT {ret}{sep}{name}_v(const long *v);")
    return "\n".join(lines) + "\n"


#: The struct types of the table by their pointer type.
_STRUCTS = {"const hbfp_operand *": ("hbfp_operand", OPERAND), "const hbfp_output *": ("hbfp_output", OUTPUT)}


def vector_arguments(name: str) -> list[tuple[str, str]]:
    """The flat arguments of ``name``'s vector entry: its parameters, a struct pointer's
    fields in its place."""
    out = []
    for arg, t in FUNCTIONS[name][1]:
        if t in _STRUCTS:
            out += [(f"{arg}.{f}", ft) for f, ft in _STRUCTS[t][1]]
        else:
            out.append((arg, t))
    return out


def vector_source() -> str:
    """C source of a vector entry ``NAME_v(const long *v)`` per function with arguments: the
    same call with every argument (and every field of a struct argument) one 64-bit slot of
    ``v``. ctypes converts one argument in about 0.3 us; a call with twenty costs more than a
    small product, and a step makes hundreds."""
    lines = ["/* Generated by hbfp.kernels.capi from its table: do not edit. */", '#include "hbfp_abi.h"', ""]
    for name, (ret, args) in FUNCTIONS.items():
        if not args:
            continue
        lines.append(f"HBFP_EXPORT {ret} {name}_v(const long *v)")
        lines.append("{")
        slot, call = 0, []
        for arg, t in args:
            if t in _STRUCTS:
                sname, fields = _STRUCTS[t]
                inits = []
                for f, ft in fields:
                    inits.append(f"({ft})v[{slot}]")
                    slot += 1
                lines.append(f"    {sname} {arg} = {{{', '.join(inits)}}};")
                call.append(f"&{arg}")
            else:
                call.append(f"({t})v[{slot}]")
                slot += 1
        lines.append(f"    return {name}({', '.join(call)});")
        lines.append("}")
        lines.append("")
    return "\n".join(lines)


def _structure(name: str, fields) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": [(f, _CTYPES[t]) for f, t in fields]})


Operand = _structure("Operand", OPERAND)
Output = _structure("Output", OUTPUT)


def declare(lib: ctypes.CDLL) -> None:
    """Sets the ctypes signature of every function of the table, and of its vector entry, on
    ``lib``."""
    for name, (ret, args) in FUNCTIONS.items():
        f = getattr(lib, name)
        f.restype = _CTYPES[ret]
        f.argtypes = [_CTYPES[t] for _, t in args]
        if args:
            v = getattr(lib, name + "_v")
            v.restype = _CTYPES[ret]
            v.argtypes = [ctypes.c_void_p]
