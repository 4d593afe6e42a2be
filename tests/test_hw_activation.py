# amaranth: UnusedElaboratable=no
"""The bf16 activation unit (``hbfp.hw.activation``) against ``hbfp.golden.activations``.

Fast checks under Amaranth's simulator (the multiplier, function subsets, leaky shifts, the
advance/valid contract), then the generated Verilog under cocotb: exhaustive over all 65,536
inputs of every function on Verilator, a random subset plus the corner cases on Icarus.
``HBFP_SIM_FULL=1`` makes Icarus exhaustive too.

(The linter line above: some tests build components only to read their elaboration-time
attributes.)
"""

import os

import numpy as np
import pytest
from amaranth.back import verilog
from amaranth.sim import Simulator

from hbfp.golden import activations, bf16
from hbfp.hw.activation import (
    FUNC_WIDTH,
    FUNCTIONS,
    GRADIENT_FUNCTIONS,
    UNARY_FUNCTIONS,
    Activation,
    ActivationDatapath,
    MulBF16Datapath,
    function_code,
    rom_bits,
    table_of,
)
from hbfp.sim import runner

FULL = os.environ.get("HBFP_SIM_FULL") == "1"

SPECIALS = np.array(
    [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x8080, 0x0100, 0x3F80, 0xBF80, 0x3FFF, 0x7F00,
     0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x1F80, 0x2000, 0x5F80],
    dtype=np.uint16,
)


def golden(code: int, x, g, functions=FUNCTIONS, shift=activations.LEAKY_SHIFT) -> np.ndarray:
    """What ``Activation(functions, leaky_shift=shift)`` must give for function ``code``."""
    x = np.asarray(x, dtype=np.uint16)
    if code >= len(FUNCTIONS) or FUNCTIONS[code] not in functions:
        return np.full(x.shape, bf16.QNAN, dtype=np.uint16)
    name = FUNCTIONS[code]
    kw = {"shift": shift} if name.startswith("leaky_relu") else {}
    if name in GRADIENT_FUNCTIONS:
        return activations.get(name[: -len("_grad")], "grad")(x, np.asarray(g, dtype=np.uint16), **kw)
    return activations.get(name)(x, **kw)


def assert_equal(got, want, what, inputs):
    """Every result bit for bit, NaNs included."""
    got = np.asarray(got, dtype=np.uint16)
    want = np.asarray(want, dtype=np.uint16)
    assert got.shape == want.shape, f"{what}: {got.size} results for {want.size} inputs"
    bad = np.nonzero(got != want)[0]
    msg = "\n".join(
        f"  in {' '.join(f'0x{int(v[k]):04x}' for v in inputs)}: expected 0x{want[k]:04x}, got 0x{got[k]:04x}"
        for k in bad[:10]
    )
    assert bad.size == 0, f"{what}: {bad.size} mismatches\n{msg}"


def run_datapath(dut, inputs: list, *, stall: float, seed: int) -> list[int]:
    """Drive an advance/valid datapath: ``advance`` drops at random (``stall``) and input
    beats come with random gaps; ``inputs`` pairs each input port with its values. Returns
    ``o`` of every result taken, in order. Also checks
    that nothing moves without ``advance``."""
    rng = np.random.default_rng(seed)
    n = len(inputs[0][1])
    got: list[int] = []

    async def bench(ctx):
        k = 0
        idle = 0
        while len(got) < n:
            advance = rng.random() >= stall
            offer = k < n and rng.random() >= stall
            ctx.set(dut.advance, advance)
            ctx.set(dut.i_valid, offer)
            if offer:
                for port, values in inputs:
                    ctx.set(port, int(values[k]))
            o_valid, o = ctx.get(dut.o_valid), ctx.get(dut.o)
            await ctx.tick()
            if advance:
                if o_valid:
                    got.append(o)
                k += offer
            else:
                assert ctx.get(dut.o_valid) == o_valid and (not o_valid or ctx.get(dut.o) == o), "moved on a stall"
            idle = 0 if advance else idle + 1
            assert idle < 100

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got


# ---------------------------------------------------------------------------------------
# Elaboration-time API
# ---------------------------------------------------------------------------------------


def test_function_codes_cover_the_golden_registry():
    assert set(UNARY_FUNCTIONS) == set(activations.UNARY)
    assert {n[: -len("_grad")] for n in GRADIENT_FUNCTIONS} == set(activations.GRADIENTS)
    assert [function_code(n) for n in FUNCTIONS] == list(range(len(FUNCTIONS)))
    assert 2**FUNC_WIDTH >= len(FUNCTIONS) > 2 ** (FUNC_WIDTH - 1)
    with pytest.raises(ValueError, match="unknown function"):
        function_code("softmax")
    assert table_of("gelu_grad") == "gelu_deriv" and table_of("exp") == "exp"
    assert table_of("relu") is None and table_of("leaky_relu_grad") is None


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown function"):
        Activation(functions=("relu", "swish"))
    with pytest.raises(TypeError):
        Activation(functions="relu")
    with pytest.raises(ValueError):
        Activation(functions=())
    with pytest.raises(ValueError):
        Activation(leaky_shift=-1)
    with pytest.raises(TypeError):
        Activation(leaky_shift=True)
    a = Activation(functions=("tanh", "relu", "tanh"), leaky_shift=np.int64(3))
    assert a.functions == ("relu", "tanh") and a.leaky_shift == 3


def test_rom_bits():
    total = sum(activations.table_unit(n).rom_bits for n in activations.TABLE_NAMES)
    assert Activation().rom_bits == rom_bits() == total == 352_256
    assert rom_bits(("relu", "leaky_relu", "relu_grad", "leaky_relu_grad")) == 0
    assert rom_bits(("gelu", "gelu_grad")) == 53_248 + 57_344
    assert ActivationDatapath(functions=("tanh",)).tables == ("tanh",)


def test_verilog_converts():
    text = verilog.convert(Activation(), name="activation")
    for port in ("i__payload", "i__valid", "i__ready", "o__payload", "o__valid", "o__ready"):
        assert port in text
    small = verilog.convert(Activation(functions=("relu", "leaky_relu_grad")), name="activation_small")
    assert "reg [15:0]" in text and len(small) < len(text) // 20  # no ROM in the small one


# ---------------------------------------------------------------------------------------
# Amaranth simulator
# ---------------------------------------------------------------------------------------


def test_mul_datapath_equals_bf16_mul():
    rng = np.random.default_rng(11)
    a_s, b_s = np.meshgrid(SPECIALS, SPECIALS)
    n = 2500
    # Uniform patterns, then pairs whose exponents sum near the overflow and FTZ edges.
    a_r = rng.integers(0, 1 << 16, n).astype(np.uint16)
    b_r = rng.integers(0, 1 << 16, n).astype(np.uint16)
    low = rng.random(n) < 0.5
    fa = np.where(low, rng.integers(1, 127, n), rng.integers(128, 255, n))
    fb = np.where(low, 127 - fa + rng.integers(0, 3, n), 382 - fa - rng.integers(0, 3, n))
    edge_a = (rng.integers(0, 2, n) << 15) | (fa << 7) | rng.integers(0, 128, n)
    edge_b = (rng.integers(0, 2, n) << 15) | (fb << 7) | rng.integers(0, 128, n)
    a = np.concatenate([a_s.ravel(), a_r, edge_a.astype(np.uint16)])
    b = np.concatenate([b_s.ravel(), b_r, edge_b.astype(np.uint16)])
    dut = MulBF16Datapath()
    got = run_datapath(dut, [(dut.a, a), (dut.b, b)], stall=0.2, seed=3)
    assert_equal(got, bf16.mul(a, b), "MulBF16Datapath", (a, b))


def _stream(dut, x, g, func, *, stall: float, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    got: list[int] = []
    n = len(x)

    async def bench(ctx):
        k = 0
        offer = False
        while len(got) < n:
            # A beat once offered stays offered, unchanged, until it is taken.
            offer = k < n and (offer or rng.random() >= stall)
            ready = rng.random() >= stall
            ctx.set(dut.i.valid, offer)
            if offer:
                ctx.set(dut.i.payload, {"x": int(x[k]), "g": int(g[k]), "func": int(func[k])})
            ctx.set(dut.o.ready, ready)
            taken = offer and ctx.get(dut.i.ready)
            if ready and ctx.get(dut.o.valid):
                got.append(ctx.get(dut.o.payload))
            await ctx.tick()
            if taken:
                k += 1
                offer = False

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got


def _mixed(seed: int, n: int):
    rng = np.random.default_rng(seed)
    x = np.concatenate([SPECIALS, rng.integers(0, 1 << 16, n).astype(np.uint16)])
    g = np.concatenate([SPECIALS[::-1], rng.integers(0, 1 << 16, n).astype(np.uint16)])
    func = rng.integers(0, 1 << FUNC_WIDTH, x.size)
    return x, g, func


def _expected(x, g, func, functions, shift=activations.LEAKY_SHIFT):
    want = np.zeros(x.shape, dtype=np.uint16)
    for code in np.unique(func):
        sel = func == code
        want[sel] = golden(int(code), x[sel], g[sel], functions, shift)
    return want


def test_activation_all_functions_with_stalls():
    x, g, func = _mixed(5, 2000)
    got = _stream(Activation(), x, g, func, stall=0.3, seed=6)
    assert_equal(got, _expected(x, g, func, FUNCTIONS), "Activation", (func, x, g))


# ("exp",) and ("relu", "gelu", "leaky_relu"): unary functions only, built without the multiplier.
@pytest.mark.parametrize("functions", [("relu", "gelu_grad", "tanh"), ("exp",), ("leaky_relu_grad", "sigmoid"),
                                       ("relu", "gelu", "leaky_relu")])
def test_functions_not_built_give_nan(functions):
    x, g, func = _mixed(7, 600)
    got = _stream(Activation(functions=functions), x, g, func, stall=0.2, seed=8)
    assert_equal(got, _expected(x, g, func, functions), f"Activation{functions}", (func, x, g))


@pytest.mark.parametrize("shift", [0, 1, 7, 120, 126, 127, 200, 254, 255, 300])
def test_leaky_shifts(shift):
    rng = np.random.default_rng(shift)
    fields = np.array(sorted({0, 1, 2, 254, 255} | {f for f in range(shift - 1, shift + 3) if 0 <= f <= 255}))
    x = ((np.arange(2)[:, None, None] << 15) | (fields[None, :, None] << 7) | np.array([0, 1, 127])).ravel()
    x = np.concatenate([x, rng.integers(0, 1 << 16, 300)]).astype(np.uint16)
    g = np.concatenate([SPECIALS, rng.integers(0, 1 << 16, x.size - SPECIALS.size)]).astype(np.uint16)
    func = rng.choice([function_code("leaky_relu"), function_code("leaky_relu_grad")], x.size)
    functions = ("leaky_relu", "leaky_relu_grad")
    got = _stream(Activation(functions=functions, leaky_shift=shift), x, g, func, stall=0.0, seed=9)
    want = _expected(x, g, func, functions, shift)
    assert_equal(got, want, f"leaky shift {shift}", (func, x, g))


@pytest.mark.parametrize("functions", [FUNCTIONS, UNARY_FUNCTIONS])
def test_full_throughput_and_latency(functions):
    """One beat per cycle in and out, the first result ``LATENCY`` cycles after the first beat
    (also without the multiplier, when only unary functions are built)."""
    dut = Activation(functions=functions)
    x, g, func = _mixed(12, 300)
    n = len(x)
    seen: list[tuple[int, int]] = []

    async def bench(ctx):
        ctx.set(dut.o.ready, 1)
        for cycle in range(n + Activation.LATENCY + 2):
            if cycle < n:
                ctx.set(dut.i.valid, 1)
                ctx.set(dut.i.payload, {"x": int(x[cycle]), "g": int(g[cycle]), "func": int(func[cycle])})
                assert ctx.get(dut.i.ready)
            else:
                ctx.set(dut.i.valid, 0)
            if ctx.get(dut.o.valid):
                seen.append((cycle, ctx.get(dut.o.payload)))
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    assert [c for c, _ in seen] == list(range(Activation.LATENCY, n + Activation.LATENCY))
    assert_equal([v for _, v in seen], _expected(x, g, func, functions), "full throughput", (func, x, g))


# ---------------------------------------------------------------------------------------
# Generated Verilog under cocotb
# ---------------------------------------------------------------------------------------

COCOTB_CASES = [
    # (simulator, functions, leaky shift): every function with the default shift on both
    # simulators; a subset build with another shift on Icarus (cheap to build).
    ("icarus", FUNCTIONS, activations.LEAKY_SHIFT),
    ("verilator", FUNCTIONS, activations.LEAKY_SHIFT),
    ("icarus", ("relu", "leaky_relu", "leaky_relu_grad", "sigmoid_grad"), 3),
]


@pytest.mark.parametrize("sim, functions, shift", COCOTB_CASES)
def test_activation_cocotb(sim, functions, shift):
    runner.require(sim)
    subset = functions != FUNCTIONS
    config = {
        "seed": 1 + shift,
        "functions": list(functions),
        "leaky_shift": shift,
        "latency": Activation.LATENCY,
        # Exhaustive on Verilator as the regular run (all 65,536 inputs of every function);
        # Icarus is about 30 times slower, so it checks a random subset unless asked for all.
        "exhaustive": (sim == "verilator" or FULL) and not subset,
        "per_function": 1000 if subset else 2500,
        "stall_beats": 1000 if subset else 3000,
        "stall": 0.3,
    }
    tests, failed = runner.run(
        lambda: Activation(functions=functions, leaky_shift=shift), "activation", "tb_activation", sim, config
    )
    assert tests == 2 and failed == 0
