"""The device contract (hbfp.contract): descriptors as fields and widths from which the host's
encoders and the gateware's views are both made, the one option parser, the configuration
rules, and the one-way dependencies (golden <- contract <- hw, host)."""

import ast
import inspect
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hbfp import contract as C
from hbfp.host import protocol as P

ROOT = Path(__file__).resolve().parents[1]


# ---- descriptors ---------------------------------------------------------------------------


def test_descriptor_wire_layouts_are_the_documented_ones():
    # docs/protocol.md's byte layouts, written out independently as struct formats.
    documented = {"header": "<HBBHI", "write": "<BBBBIHHHH", "gemm": "<HHHBBBBHI", "read": "<HHBBBBI",
                  "elementwise": "<BBHI", "identity": "<BBBBHHBBBBHHIIII", "status": "<IIIBBH", "cycles": "<I"}
    for d in (C.HEADER, C.WRITE, C.GEMM, C.READ, C.ELEMENTWISE, C.IDENTITY, C.STATUS, C.CYCLES):
        assert d.struct.format == documented[d.name], d.name
        assert d.size == struct.calcsize(documented[d.name])


def test_encoders_match_a_hand_packed_record():
    assert P.encode_gemm(5, 6, 7, transpose_b=True, bias=True, activation=2, out_format=C.OutFormat.BF16,
                         rounding=C.Rounding.STOCHASTIC, seed=0xDEADBEEF) == \
        struct.pack("<HHHBBBBHI", 5, 6, 7, 2 | 8, 2, 1, 2, 0, 0xDEADBEEF)
    assert P.encode_read(3, 4, out_format=C.OutFormat.BFP, activation=1, bias=True, seed=9) == \
        struct.pack("<HHBBBBI", 3, 4, 2, 1, 8, 0, 9)
    assert P.encode_write(C.Target.B_VALUES, 24, 48, 24, 24, b"xy", encoding=1, rounding=1, seed=-1) == \
        struct.pack("<BBBBIHHHH", 7, 1, 1, 0, 0xFFFFFFFF, 24, 48, 24, 24) + b"xy"
    assert P.encode_elementwise(3, b"abcd") == struct.pack("<BBHI", 3, 0, 0, 2) + b"abcd"


def test_descriptor_round_trip_and_range_checks():
    values = dict(m=96, n=1, k=65535, flags=15, activation=255, out_format=2, rounding=2, seed=2**32 - 1)
    assert C.GEMM.unpack(C.GEMM.pack(**values)) == values
    with pytest.raises(ValueError, match="does not fit 16 bits"):
        C.GEMM.pack(m=65536)
    with pytest.raises(ValueError, match="unknown fields"):
        C.GEMM.pack(mm=1)
    with pytest.raises(ValueError, match="duplicate"):
        C.Descriptor("bad", [("a", 8), ("a", 8)])
    with pytest.raises(ValueError, match="not 8, 16 or 32"):
        C.Descriptor("bad", [("a", 12)])


def test_gateware_views_have_the_wire_offsets():
    from amaranth import Shape

    from hbfp.hw.params import layout

    for d in (C.WRITE, C.GEMM, C.READ, C.ELEMENTWISE, C.IDENTITY, C.STATUS, C.HEADER):
        view = layout(d)
        assert view.size == 8 * d.size
        for f in d.fields:
            assert view[f.name].offset == 8 * d.offsets[f.name], (d.name, f.name)
            assert Shape.cast(view[f.name].shape).width == f.bits


def test_identity_and_status_round_trip():
    ident = C.DeviceSpec(C.CoreConfig(rows=4, cols=2, size=48, functions=("relu", "gelu_grad"), stochastic=False),
                         stream_bytes=16, clock_hz=12_000_000, max_payload=600, frame_timeout=5000).identity()
    assert C.Identity.decode(ident.encode()) == ident
    assert ident.functions == ("relu", "gelu_grad") and ident.units == ("value_quantizer", "bfp_output")
    assert ident.omitted == 1 << C.Unit.STOCHASTIC
    s = C.DeviceStatus(3, 2, 14_000, C.Status.BAD_CRC)
    assert C.DeviceStatus.decode(s.encode()) == s
    with pytest.raises(ValueError, match="unknown unit"):
        ident.has("quantizer")


def test_codes():
    assert [r.label for r in C.Rounding] == ["nearest_even", "toward_zero", "stochastic"]
    assert C.Rounding.from_label("toward_zero") == 1
    with pytest.raises(ValueError, match="unknown rounding mode"):
        C.Rounding.from_label("up")
    assert C.OutFormat.from_label("bfp") == C.OutFormat.BFP
    assert [C.function_code(f) for f in C.FUNCTIONS] == list(range(len(C.FUNCTIONS)))
    assert C.mask_functions(C.functions_mask(["tanh", "relu"])) == ("relu", "tanh")
    assert C.frame_size(1) == len(P.encode_reply(C.Op.WRITE, 0))


# ---- options, specs and configurations ----------------------------------------------------------


def test_one_parser_for_emu_and_sim():
    from hbfp.host.emu import parse_options as emu_options
    from hbfp.sim.device import parse_arg as sim_options

    arg = "format=MXINT8,rows=4,cols=4,size=96,functions=relu+gelu,bfp_output=off,clock_hz=12000000"
    sim = sim_options(arg)
    parsed = emu_options(arg)
    assert parsed.pop("wire") is False and emu_options("wire=1")["wire"] is True  # emu's own option
    emu = C.DeviceSpec(parsed.pop("config"), **parsed)
    assert C.DeviceSpec.from_options(sim) == emu
    assert emu.config.tile == (1, 32) and emu.config.functions == ("relu", "gelu") and not emu.config.bfp_output
    with pytest.raises(C.ConfigError, match="unknown emu option 'colz'"):
        emu_options("colz=4")
    with pytest.raises(C.ConfigError, match="sim option rows: expected an integer"):
        sim_options("rows=four")
    with pytest.raises(C.ConfigError, match="unknown function"):
        emu_options("functions=relu+swish")


def test_device_defaults_are_the_gateware_tops():
    from hbfp.hw.packet import PacketEngine
    from hbfp.hw.top import AcceleratorTop

    spec = C.DeviceSpec()
    for cls in (AcceleratorTop, PacketEngine):
        params = inspect.signature(cls).parameters
        for name in ("stream_bytes", "clock_hz", "max_payload", "frame_timeout"):
            assert params[name].default == getattr(spec, name), (cls.__name__, name)
    import hbfp.host as host

    assert host.open("emu").info() == spec.identity()


@pytest.mark.parametrize("kwargs, rule", [
    (dict(rows=2, cols=2, tile=(8, 8), size=16), "read-modify-write"),
    (dict(rows=5), "array sides"),
    (dict(out_lanes=3), "out_lanes must divide"),
    (dict(size=100), "multiple of the tile sides"),
    (dict(rows=32, cols=8, size=96), "K-tile"),
    (dict(value_quantizer=1), "True or False"),
    (dict(functions="relu"), "functions must be names"),
    (dict(mantissa_bits=17), "mantissa_bits"),
])
def test_config_rules_are_typed_errors(kwargs, rule):
    with pytest.raises(C.ConfigError, match=rule):
        C.CoreConfig(**kwargs)


def test_config_rules_hold_under_python_O():
    code = ("from hbfp.contract import CoreConfig, ConfigError\n"
            "try:\n    CoreConfig(rows=2, cols=2, tile=(8, 8), size=16)\nexcept ConfigError as e:\n    print('refused', e)\n")
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("refused the accumulator's read-modify-write"), r.stdout + r.stderr


# ---- dependencies run one way ------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within the package
                names.add("." * node.level + (node.module or ""))
            else:
                names.add(node.module or "")
    return names


#: Files allowed one of their folder's forbidden imports.
ALLOWED: dict = {}


@pytest.mark.parametrize("folder, forbidden", [
    # golden is the reference: it reaches the fast implementations only through the registry
    # (hbfp.kernels, imported where a call asks for it), nothing else of ours
    ("golden", ("hbfp.contract", "hbfp.hw", "hbfp.host", "hbfp.sim", "hbfp.torch", "amaranth", "torch")),
    ("hbfp/kernels", ("hbfp.contract", "hbfp.hw", "hbfp.host", "hbfp.sim", "hbfp.torch", "amaranth")),
    ("host", ("hbfp.hw", "hbfp.sim", "amaranth", "cocotb")),
    ("hbfp/torch", ("hbfp.hw", "hbfp.sim", "amaranth", "cocotb")),
])
def test_dependencies_run_one_way(folder, forbidden):
    bad = []
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    for f in files:
        rel = str(f.relative_to(ROOT))
        for name in _imports(f):
            if any(name == m or name.startswith(m + ".") for m in forbidden if m not in ALLOWED.get(rel, ())):
                bad.append(f"{rel} imports {name}")
    contract_imports = _imports(ROOT / "hbfp" / "contract.py")
    assert not [n for n in contract_imports if n.startswith(("hbfp.hw", "hbfp.host", "hbfp.sim", "amaranth"))]
    assert not bad, bad


def _without_hdl(code: str, *args) -> subprocess.CompletedProcess:
    """Runs ``code`` in a Python where Amaranth and cocotb cannot be imported, as after
    ``pip install hbfp`` without the hw and sim extras."""
    blocker = ("import sys, importlib.abc\n"
               "class NoHdl(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('amaranth', 'amaranth_boards', 'cocotb', 'cocotb_tools'):\n"
               "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
               "sys.meta_path.insert(0, NoHdl())\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", blocker + code, *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_golden_model_loads_no_torch():
    r = subprocess.run([sys.executable, "-c",
                        "import sys, numpy as np, hbfp.golden\n"
                        "from hbfp.golden.gemm import gemm\n"
                        "q = hbfp.golden.quantize(np.ones((30, 30), np.float32))\n"
                        "gemm(q, q)\n"
                        "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_host_only_import_and_use():
    r = _without_hdl(
        "import numpy as np, hbfp.host, hbfp.torch\n"
        "d = hbfp.host.open('emu:rows=4,cols=4,size=48')\n"
        "a = np.ones((30, 50), np.float32)\n"
        "assert (d.gemm(a, a.T) == hbfp.host.reference_gemm(d.format(), a, a.T)).all()\n"
        "assert d.activation('gelu', np.ones(3, np.float32)).shape == (3,)\n"
        "print('loaded', [m for m in ('amaranth', 'cocotb', 'cocotb_tools') if m in sys.modules])\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "loaded []"


def test_hdl_commands_without_the_extra_say_what_to_install(tmp_path):
    r = _without_hdl("from hbfp.cli import main; sys.exit(main(sys.argv[1:]))", "verilog", "-o", str(tmp_path / "v"))
    assert r.returncode == 2
    assert "pip install 'hbfp[hw]'" in r.stderr and "Traceback" not in r.stderr
    r = _without_hdl("from hbfp.cli import main; sys.exit(main(sys.argv[1:]))", "info", "sim")
    # the sim device needs the simulators as well as the HDL: hbfp[sim], not hbfp[hw] (whose Amaranth is what it misses first)
    assert r.returncode == 2 and "pip install 'hbfp[sim]'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _without_hdl("import hbfp.host\ntry:\n    hbfp.host.open('sim')\nexcept hbfp.host.BackendError as e:\n    print(e)\n")
    assert "pip install 'hbfp[sim]'" in r.stdout and "'amaranth' is missing" in r.stdout, (r.stdout, r.stderr[-2000:])
