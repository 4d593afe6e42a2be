"""Verilog of the GEMM core and of each component, plus the parameters file (``hbfp verilog``).

The parameters file (``params.json``) is what the host and the tests read about a build:
the configuration, every derived width and latency, and the codes of the runtime ports.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from amaranth.back import verilog

from hbfp import __version__

from . import accumulate, activation, add_f32, buffers, epilogue, gemm_core, mac_array, normalize, packet, quantize, top
from hbfp.contract import OutFormat, Target

from .params import EXP_BIAS, EXP_NAN, RANDOM_BITS, ROUNDING_CODES, SEED_SALT, CoreConfig, psum_width

__all__ = ["components", "parameters", "generate"]


def components(cfg: CoreConfig) -> dict:
    """Name -> constructor of every component of the core, as configured in ``cfg``, and
    "top" (the accelerator with its protocol engine, default link parameters)."""
    m, tk = cfg.mantissa_bits, cfg.tk
    functions = cfg.built_functions
    units = {}  # the optional units, when built
    if functions:
        units["activation"] = lambda: activation.Activation(functions=functions, leaky_shift=cfg.leaky_shift)
    if cfg.value_quantizer or cfg.bfp_output:
        # The input quantizer's shape (the output quantizer is the epilogue's).
        units["quantize"] = lambda: quantize.Quantize(m, cfg.tile, packet.value_lanes(cfg), "fp32",
                                                      stochastic=cfg.stochastic)
    return {
        "gemm_core": lambda: gemm_core.GemmCore(cfg),
        "mac_array": lambda: mac_array.MacArray(cfg.rows, cfg.cols, tk, m, m),
        "accumulate": lambda: accumulate.Accumulate(cfg),
        "epilogue": lambda: epilogue.Epilogue(cfg, gemm_core.command_layout(cfg)),
        "normalize": lambda: normalize.Normalize(psum_width(m, m, tk), m, m),
        "add_f32": lambda: add_f32.AddF32(),
        **units,
        "operand_buffer_a": lambda: buffers.OperandBuffer(cfg.rows, m, cfg.size, cfg.size),
        "operand_buffer_b": lambda: buffers.OperandBuffer(cfg.cols, m, cfg.size, cfg.size),
        "top": lambda: top.AcceleratorTop(cfg),
    }


def parameters(cfg: CoreConfig) -> dict:
    """Everything a host or a test needs to know about a build of ``cfg``."""
    core = gemm_core
    return {
        "hbfp_version": __version__,
        "config": cfg.to_dict(),
        "formats": {"exp_bias": EXP_BIAS, "exp_nan": EXP_NAN, "random_bits": RANDOM_BITS, "seed_salt": SEED_SALT},
        "latency": {
            "normalize": normalize.NormalizeDatapath.LATENCY,
            "add_f32": add_f32.AddF32Datapath.LATENCY,
            "activation": activation.ActivationDatapath.LATENCY,
            "mac_array": mac_array.MacArray.LATENCY,
        },
        "codes": {
            "write_targets": {t.name.lower(): int(t) for t in Target},
            "out_formats": {f.label: int(f) for f in OutFormat},
            "rounding": ROUNDING_CODES,
            "functions": {name: i for i, name in enumerate(activation.FUNCTIONS)},
            "functions_built": list(cfg.built_functions),
        },
        "ports": {
            "w": {name: _width(f.shape) for name, f in core.write_layout(cfg)},
            "cmd": {name: _width(f.shape) for name, f in core.command_layout(cfg)},
            "o": {name: _width(f.shape) for name, f in core.output_layout(cfg)},
        },
        "rom_bits": activation.rom_bits(cfg.built_functions) if cfg.built_functions else 0,
    }


def _width(shape) -> int:
    from amaranth import Shape
    from amaranth.lib import data

    if isinstance(shape, data.Layout):
        return shape.size
    return Shape.cast(shape).width


#: ``hbfp verilog``'s record of the files it wrote into its folder (``hbfp.outputs``).
MANIFEST = ".hbfp-verilog.json"


def generated_files(cfg: CoreConfig, only: list[str] | None = None) -> list[str]:
    """The files ``generate`` writes: ``<name>.v`` of each component made, then ``params.json``."""
    return [f"{name}.v" for name in components(cfg) if not only or name in only] + ["params.json"]


def generate(cfg: CoreConfig, outdir: Path, *, only: list[str] | None = None, log=print, platform=None,
             write=None) -> dict:
    """Write ``<name>.v`` for the core and every component (or the ``only`` ones) and
    ``params.json`` into ``outdir`` (``generated_files``); returns the parameters.
    ``platform``: what the components are elaborated for (None: portable Verilog, as the
    simulators run it; ``hbfp.hw.openflow.ECP5``: with ECP5 primitives where they help, e.g.
    the MAC array's registered DSP blocks). ``write(name, text)``: how a file is written
    (``hbfp.outputs.Output.put``; default: into ``outdir``, made if need be)."""
    outdir = Path(outdir)
    if write is None:
        outdir.mkdir(parents=True, exist_ok=True)

        def write(name, text):
            (outdir / name).write_text(text)
    params = parameters(cfg)
    made = {}
    for name, make in components(cfg).items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        text = verilog.convert(make(), name=name, platform=platform)
        write(f"{name}.v", text)
        made[name] = f"{name}.v"
        log(f"  {outdir / made[name]} ({len(text) / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    params["verilog"] = made
    write("params.json", json.dumps(params, indent=2) + "\n")
    log(f"  {outdir / 'params.json'}")
    return params
