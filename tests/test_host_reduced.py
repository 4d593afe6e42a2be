"""Reduced devices (built without the value quantizer, the BFP output quantizer, stochastic
rounding, or some or all activation units) on ``emu``: IDENTIFY's ``omitted`` mask and
``functions``, the requests such a device refuses, and the driver's host-side fallbacks, whose
results equal the golden model on the whole problem."""

import itertools
import struct

import numpy as np
import pytest

import hbfp.host as host
from hbfp.golden import bf16
from hbfp.golden.compare import same_bits
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice, parse_options
from hbfp.host.protocol import Op, OutFormat, Status, Target
from hbfp.host.transports import LoopbackTransport
from hbfp.contract import FUNCTIONS, GRADIENT_FUNCTIONS, UNARY_FUNCTIONS
from hbfp.contract import CoreConfig

from .conftest import SMALL  # 4x4, 48x48 buffers: everything above 48 is tiled

#: A payload buffer for a whole buffer of fp32 values: an operand block travels in one WRITE
#: (the expected host work below counts blocks, not WRITE chunks).
WHOLE = P.WRITE_HEADER + 4 * 48 * 48
#: name -> (the units built, the CoreConfig fields left out)
CONFIGS = {
    "full": (("value_quantizer", "bfp_output", "stochastic"), {}),
    "no_value_quantizer": (("bfp_output", "stochastic"), dict(value_quantizer=False)),
    "no_bfp_output": (("value_quantizer", "stochastic"), dict(bfp_output=False)),
    "no_stochastic": (("value_quantizer", "bfp_output"), dict(stochastic=False)),
    "minimal": ((), dict(value_quantizer=False, bfp_output=False, stochastic=False)),
}
REDUCED = [name for name in CONFIGS if name != "full"]
#: The mask each reports: bit 0 value_quantizer, bit 1 bfp_output, bit 2 stochastic.
MASKS = {"full": 0, "no_value_quantizer": 1, "no_bfp_output": 2, "no_stochastic": 4, "minimal": 7}


class Recording(EmuDevice):
    """An EmuDevice that keeps every request frame it receives (products through the wire)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, wire=True, **kwargs)
        self.requests = []
        self._seen = P.FrameParser()

    def write(self, data: bytes) -> None:
        self.requests += [f for f in self._seen.feed(bytes(data)) if isinstance(f, P.Frame)]
        super().write(data)


def open_device(name: str, **extra) -> host.Device:
    return host.Device(LoopbackTransport(Recording(CoreConfig(**SMALL, **CONFIGS[name][1], **extra), max_payload=WHOLE)), name=name)


@pytest.fixture(scope="module", params=list(CONFIGS))
def dev(request):
    with open_device(request.param) as d:
        yield d


def operands(rng, m, k, n, transpose_a=False, transpose_b=False):
    a = rng.standard_normal((k, m) if transpose_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    return a, b


def expected_host_quantized(units, input, out, rounding, split_operands, split_out, host_activation=False):
    """The driver's fallbacks, as docs/host.md states them: an operand sent as values is
    quantized on the host when the device has no value quantizer, when stochastic rounding is
    asked of a device without it, or when it is stochastic and split; a BFP output likewise,
    and also after an activation applied on the host."""
    stochastic = rounding == "stochastic"

    def on_device(unit):
        return unit in units and ("stochastic" in units or not stochastic)

    n = 0
    if input != "codes" and (not on_device("value_quantizer") or (stochastic and split_operands)):
        n += 2
    if out == "bfp" and (host_activation or not on_device("bfp_output") or (stochastic and split_out)):
        n += 1
    return n


def check_requests(d: host.Device) -> list:
    """Nothing the device lacks was asked of it (the requests checked are returned)."""
    units = d.identity.units
    built = d.transport.device.config.built_functions
    for f in d.transport.device.requests:
        if f.opcode == Op.WRITE:
            target, _, rounding, *_ = P.decode_write(f.payload)
            if target in (Target.A_VALUES, Target.B_VALUES):
                assert "value_quantizer" in units
                assert rounding != 2 or "stochastic" in units
        elif f.opcode in (Op.GEMM, Op.READ):
            desc = (P.decode_gemm if f.opcode == Op.GEMM else P.decode_read)(f.payload)
            if desc["out_format"] == OutFormat.BFP:
                assert "bfp_output" in units
                assert desc["rounding"] != 2 or "stochastic" in units
            act = desc["activation"]
            assert act == P.NO_ACTIVATION or FUNCTIONS[act] in built and FUNCTIONS[act] in UNARY_FUNCTIONS
        elif f.opcode == Op.ELEMENTWISE:
            assert FUNCTIONS[P.decode_elementwise(f.payload)[0]] in built
    requests = list(d.transport.device.requests)
    d.transport.device.requests.clear()
    return requests


# ---- products equal the golden model ---------------------------------------------------------


@pytest.mark.parametrize("rounding", ["nearest_even", "toward_zero", "stochastic"])
@pytest.mark.parametrize("out", ["fp32", "bf16", "bfp"])
@pytest.mark.parametrize("input", ["codes", "fp32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(20, 30, 40), (60, 100, 50)])  # one block; split along M, N and K
def test_products_equal_golden(dev, m, k, n, input, out, rounding):
    rng = np.random.default_rng(m + k + n)
    a, b = operands(rng, m, k, n)
    kw = dict(input=input, out=out, rounding=rounding, seed=5, bias=rng.standard_normal(n).astype(np.float32),
              activation="gelu" if out != "fp32" else None)
    if m > 48:
        kw["c"] = rng.standard_normal((m, n)).astype(np.float32)
    before = dev.stats.copy()
    got = dev.gemm(a, b, **kw)
    assert same_bits(got, host.reference_gemm(dev.format(), a, b, **kw)), (dev.name, kw)
    split = m > 48
    want = expected_host_quantized(dev.identity.units, input, out, rounding, split, split)
    assert (dev.stats - before).host_quantized == want
    check_requests(dev)


@pytest.mark.parametrize("name", REDUCED)
@pytest.mark.parametrize("m,k,n,ta,tb", [(60, 30, 20, True, False), (20, 30, 60, False, True),
                                         (20, 110, 10, True, True), (49, 49, 49, False, False)])
def test_split_along_one_side(name, m, k, n, ta, tb):
    rng = np.random.default_rng(m * n + k)
    a, b = operands(rng, m, k, n, ta, tb)
    with open_device(name) as d:
        for input, out, rounding in [("fp32", "bfp", "stochastic"), ("bf16", "bfp", "toward_zero"),
                                     ("fp32", "bf16", "nearest_even"), ("codes", "bfp", "stochastic")]:
            kw = dict(input=input, out=out, rounding=rounding, seed=(1, 2, 3), transpose_a=ta, transpose_b=tb,
                      bias=rng.standard_normal(n).astype(np.float32), activation="relu",
                      c=rng.standard_normal((m, n)).astype(np.float32))
            assert same_bits(d.gemm(a, b, **kw), host.reference_gemm(d.format(), a, b, **kw)), (name, kw)
            check_requests(d)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m,n", [(10, 20), (60, 50)])
def test_c_alone(name, m, n):
    """K = 0: the product is C (read through the epilogue); value operands are not sent."""
    rng = np.random.default_rng(m)
    a, b = np.zeros((m, 0), np.float32), np.zeros((0, n), np.float32)
    kw = dict(c=rng.standard_normal((m, n)).astype(np.float32), bias=rng.standard_normal(n).astype(np.float32),
              activation="tanh", out="bfp", input="fp32", rounding="stochastic", seed=9)
    with open_device(name) as d:
        assert same_bits(d.gemm(a, b, **kw), host.reference_gemm(d.format(), a, b, **kw))
        assert d.stats.host_quantized == expected_host_quantized(CONFIGS[name][0], "codes", "bfp", "stochastic",
                                                                 False, m > 48)
        check_requests(d)


def test_non_square_tiles():
    """MXINT8 (1 x 32 blocks) on a device with no optional unit."""
    rng = np.random.default_rng(3)
    a, b = operands(rng, 70, 100, 40, transpose_b=True)
    with host.open("emu:format=MXINT8,rows=4,cols=4,size=64,value_quantizer=0,bfp_output=0,stochastic=0") as d:
        assert d.identity.units == ()
        for input, out, rounding in [("fp32", "bfp", "stochastic"), ("bf16", "bfp", "nearest_even")]:
            kw = dict(input=input, out=out, rounding=rounding, seed=4, transpose_b=True)
            before = d.stats.host_quantized
            assert same_bits(d.gemm(a, b, **kw), host.reference_gemm(d.format(), a, b, **kw))
            assert d.stats.host_quantized - before == 3


def test_discarded_partial_replies_in_bf16_without_the_output_quantizer():
    """K chunks before the last ask for BFP (the smaller for 48 x 48 blocks), or bf16 on a
    device without BFP output."""
    rng = np.random.default_rng(8)
    a, b = operands(rng, 48, 96 + 24, 48)  # three K chunks: 48, 48, 24
    got = {}
    for name in ("full", "no_bfp_output"):
        with open_device(name) as d:
            assert same_bits(d.gemm(a, b), host.reference_gemm(d.format(), a, b))
            gemms = [P.decode_gemm(f.payload) for f in d.transport.device.requests if f.opcode == Op.GEMM]
            assert [g["k"] for g in gemms] == [48, 48, 24]
            got[name] = ([g["out_format"] for g in gemms], d.stats.bytes_received)
    assert got["full"][0] == [OutFormat.BFP, OutFormat.BFP, OutFormat.FP32]
    assert got["no_bfp_output"][0] == [OutFormat.BF16, OutFormat.BF16, OutFormat.FP32]
    # Two 48 x 48 partial replies: bf16 (2 bytes a value) instead of 2 x 2 tiles of 1 + 576 bytes.
    assert got["no_bfp_output"][1] - got["full"][1] == 2 * (48 * 48 * 2 - 4 * 577)


def test_discarded_partial_replies_take_the_smaller_format():
    """A small block's partial reply is smaller in bf16 than in padded BFP tiles: 5 x 3
    values are 30 bytes in bf16, one tile of 1 + 576 bytes in BFP."""
    rng = np.random.default_rng(9)
    a, b = operands(rng, 5, 96 + 24, 3)
    with open_device("full") as d:
        assert same_bits(d.gemm(a, b), host.reference_gemm(d.format(), a, b))
        gemms = [P.decode_gemm(f.payload) for f in d.transport.device.requests if f.opcode == Op.GEMM]
    assert [g["out_format"] for g in gemms] == [OutFormat.BF16, OutFormat.BF16, OutFormat.FP32]


# ---- what a reduced device refuses --------------------------------------------------------


def values_write(target=Target.A_VALUES, rounding=0, encoding=P.Encoding.FP32, row=0, rows=24, data=None):
    width = 4 if encoding == P.Encoding.FP32 else 2
    if data is None:
        data = bytes(rows * 24 * width)
    return P.encode_write(target, row, 0, rows, 24, data, encoding=encoding, rounding=rounding, seed=1)


def refusal(d: host.Device, op: Op, payload: bytes):
    """The status the device answers ``payload`` with (OK or the refusal)."""
    try:
        d.command(op, payload)
    except host.DeviceError as e:
        return e.status
    return Status.OK


# (request, units that must be built for it to be accepted)
REQUESTS = {
    "write A values": ((Op.WRITE, values_write()), ("value_quantizer",)),
    "write B values bf16": ((Op.WRITE, values_write(Target.B_VALUES, encoding=P.Encoding.BF16)), ("value_quantizer",)),
    "write values stochastic": ((Op.WRITE, values_write(rounding=2)), ("value_quantizer", "stochastic")),
    "write nothing as values": ((Op.WRITE, values_write(rows=0)), ("value_quantizer",)),
    "gemm bfp": ((Op.GEMM, P.encode_gemm(8, 8, 8, out_format=OutFormat.BFP, rounding=1)), ("bfp_output",)),
    "gemm bfp stochastic": ((Op.GEMM, P.encode_gemm(8, 8, 8, out_format=OutFormat.BFP, rounding=2, seed=3)),
                            ("bfp_output", "stochastic")),
    "gemm fp32, rounding unused": ((Op.GEMM, P.encode_gemm(8, 8, 8, out_format=OutFormat.FP32, rounding=2)), ()),
    "gemm bf16, rounding unused": ((Op.GEMM, P.encode_gemm(8, 8, 8, out_format=OutFormat.BF16, rounding=2)), ()),
    "read bfp": ((Op.READ, P.encode_read(8, 8, out_format=OutFormat.BFP)), ("bfp_output",)),
    "read bfp stochastic": ((Op.READ, P.encode_read(8, 8, out_format=OutFormat.BFP, rounding=2)),
                            ("bfp_output", "stochastic")),
    "read bf16, rounding unused": ((Op.READ, P.encode_read(8, 8, out_format=OutFormat.BF16, rounding=2)), ()),
    "write codes": ((Op.WRITE, P.encode_write(Target.A_CODES, 0, 0, 1, 4, bytes(4))), ()),
}


@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_refused_with_bad_descriptor(dev, request_name):
    (op, payload), needs = REQUESTS[request_name]
    built = all(u in CONFIGS[dev.name][0] for u in needs)
    assert refusal(dev, op, payload) == (Status.OK if built else Status.BAD_DESCRIPTOR)
    if not built:
        assert dev.status().last_error == Status.BAD_DESCRIPTOR


@pytest.mark.parametrize("name", REDUCED)
def test_check_order(name):
    """WRITE: length < header, region (BAD_ADDRESS), descriptor (BAD_DESCRIPTOR), data length
    (BAD_LENGTH); GEMM/READ: length, then descriptor."""
    d = host.Device(LoopbackTransport(EmuDevice(CoreConfig(**SMALL, **CONFIGS[name][1]), max_payload=WHOLE)), retries=0)
    units = CONFIGS[name][0]
    # A short data field: BAD_LENGTH where the descriptor passes, BAD_DESCRIPTOR first where not.
    short = Status.BAD_LENGTH if "value_quantizer" in units else Status.BAD_DESCRIPTOR
    short_stochastic = Status.BAD_LENGTH if {"value_quantizer", "stochastic"} <= set(units) else Status.BAD_DESCRIPTOR
    assert refusal(d, Op.WRITE, values_write()[: P.WRITE_HEADER - 1]) == Status.BAD_LENGTH
    assert refusal(d, Op.WRITE, values_write(row=12)) == Status.BAD_ADDRESS  # unaligned
    assert refusal(d, Op.WRITE, values_write(row=48)) == Status.BAD_ADDRESS  # outside
    assert refusal(d, Op.WRITE, values_write(rounding=2, row=40)) == Status.BAD_ADDRESS
    assert refusal(d, Op.WRITE, values_write(data=b"short")) == short
    assert refusal(d, Op.WRITE, values_write(rounding=2, data=b"short")) == short_stochastic
    assert refusal(d, Op.WRITE, values_write(rounding=3)) == Status.BAD_DESCRIPTOR
    gemm = P.encode_gemm(8, 8, 8, out_format=OutFormat.BFP)
    assert refusal(d, Op.GEMM, gemm[:-1]) == Status.BAD_LENGTH
    assert refusal(d, Op.READ, P.encode_read(8, 8, out_format=OutFormat.BFP) + b"\0") == Status.BAD_LENGTH
    assert refusal(d, Op.GEMM, gemm) == (Status.OK if "bfp_output" in units else Status.BAD_DESCRIPTOR)
    assert refusal(d, Op.GEMM, P.encode_gemm(8, 8, 8, out_format=OutFormat.FP32, rounding=3)) == Status.BAD_DESCRIPTOR


# ---- identity, ABI, options ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_identity_reports_the_omitted_units(name):
    units, fields = CONFIGS[name]
    with host.open(f"emu:rows=4,cols=4,size=48,max_payload={WHOLE}", config=CoreConfig(**SMALL, **fields)) as d:
        ident = d.info()
        raw = d.command(Op.IDENTIFY)
    assert ident.omitted == MASKS[name] and struct.unpack_from("<I", raw, 28)[0] == MASKS[name]
    assert ident.units == units
    assert [ident.has(u) for u in ("value_quantizer", "bfp_output", "stochastic")] == \
        [u in units for u in ("value_quantizer", "bfp_output", "stochastic")]
    assert ident.abi == (1, 1)


def test_identity_round_trip():
    ident = P.Identity(1, 1, 1, 4, 8, 8, 8, 24, 24, 7, 96, 0x7FF, 0, 4096, 1000, omitted=0b101)
    data = P.encode_identity(ident)
    assert len(data) == 32 and data[28:] == bytes([5, 0, 0, 0]) and P.decode_identity(data) == ident
    assert ident.units == ("bfp_output",) and not ident.has("stochastic") and ident.has("bfp_output")
    with pytest.raises(ValueError, match="unknown unit 'fp64'.*value_quantizer, bfp_output, stochastic"):
        ident.has("fp64")
    old = P.Identity(1, 1, 0, 4, 8, 8, 8, 24, 24, 7, 96, 0x7FF, 0, 4096, 1000)  # an ABI 1.0 reply
    assert old.omitted == 0 and old.units == ("value_quantizer", "bfp_output", "stochastic")


def test_abi_1_0_device_is_a_full_device():
    """An ABI 1.0 device sends 0 at offset 28 (reserved then): every unit, no fallback."""
    emu = Recording(CoreConfig(**SMALL), abi_version=(1, 0), max_payload=WHOLE)
    with host.Device(LoopbackTransport(emu)) as d:
        raw = d.command(Op.IDENTIFY)
        assert raw[28:32] == bytes(4) and d.info().abi == (1, 0)
        assert d.identity.units == ("value_quantizer", "bfp_output", "stochastic")
        rng = np.random.default_rng(1)
        # One block, stochastic: the device quantizes operands and output.
        # K = 100 = 48 + 48 + 4, toward_zero: values block by block, BFP partial replies.
        for (m, k, n), rounding in [((20, 40, 30), "stochastic"), ((20, 100, 30), "toward_zero")]:
            emu.requests.clear()
            a, b = operands(rng, m, k, n)
            kw = dict(input="bf16", out="bfp", rounding=rounding, seed=2)
            assert same_bits(d.gemm(a, b, **kw), host.reference_gemm(d.format(), a, b, **kw))
            writes = [P.decode_write(f.payload) for f in emu.requests if f.opcode == Op.WRITE]
            assert {w[0] for w in writes} == {Target.A_VALUES, Target.B_VALUES}
            assert {w[2] for w in writes} == {P.ROUNDING_CODES[rounding]}
            gemms = [P.decode_gemm(f.payload)["out_format"] for f in emu.requests if f.opcode == Op.GEMM]
            assert gemms == [OutFormat.BFP] * -(-k // 48)
        assert d.stats.host_quantized == 0


def test_option_parser():
    for text, value in [("0", False), ("1", True), ("false", False), ("True", True), ("no", False),
                        ("YES", True), ("off", False), ("on", True)]:
        cfg = parse_options(f"rows=4,cols=4,size=48,bfp_output={text}")["config"]
        assert cfg.bfp_output is value and cfg.value_quantizer is True and cfg.stochastic is True
    cfg = parse_options("value-quantizer=off,stochastic=no")["config"]
    assert (cfg.value_quantizer, cfg.bfp_output, cfg.stochastic) == (False, True, False)
    assert EmuDevice(**parse_options("size=48,value_quantizer=0,bfp_output=0,stochastic=0")).identity.omitted == 7
    for bad in ("bfp_output=2", "stochastic=maybe", "value_quantizer="):
        with pytest.raises(ValueError, match="expected 0/1, true/false, yes/no or on/off"):
            parse_options(bad)
    with pytest.raises(ValueError, match="unknown emu option 'fp64'.*value_quantizer, bfp_output, stochastic"):
        parse_options("fp64=1")
    with pytest.raises(ValueError, match="stochastic rounding needs a quantizer"):
        parse_options("value_quantizer=0,bfp_output=0")  # stochastic rounding is a quantizer's
    with host.open("emu:rows=4,cols=4,size=48,stochastic=off") as d:
        assert d.identity.units == ("value_quantizer", "bfp_output")


# ---- devices without some or all activation units ---------------------------------------------

#: name -> the activation units built (CoreConfig.functions)
FUNCTION_SETS = {"no_functions": (), "relu_only": ("relu",), "no_gradients": UNARY_FUNCTIONS}
ACTIVATIONS = (None,) + UNARY_FUNCTIONS


def open_functions(functions, units="full", **extra) -> host.Device:
    return open_device(units, functions=functions, **extra)


@pytest.fixture(scope="module", params=[("no_functions", "full"), ("no_functions", "minimal"),
                                        ("relu_only", "full"), ("relu_only", "no_stochastic")],
                ids="-".join)
def fdev(request):
    functions, units = request.param
    with open_functions(FUNCTION_SETS[functions], units) as d:
        yield d


@pytest.mark.parametrize("m,k,n", [(20, 30, 40), (60, 100, 50)])  # one block; split along M, N and K
def test_products_with_activations_on_the_host(fdev, m, k, n):
    """Every unary activation, built or not, x outputs x roundings x bias: the golden model's
    bits; the host applies exactly the activations the device lacks, and counts them."""
    rng = np.random.default_rng(m + n)
    a, b = operands(rng, m, k, n)
    c = rng.standard_normal((m, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    built = fdev.identity.functions
    units = fdev.identity.units
    split = m > 48
    for i, (activation, out, rounding) in enumerate(itertools.product(
            ACTIVATIONS, ["fp32", "bf16", "bfp"], ["nearest_even", "toward_zero", "stochastic"])):
        kw = dict(activation=activation, out=out, rounding=rounding, seed=i,
                  input=("codes", "fp32", "bf16")[i % 3], bias=bias if i % 2 else None, c=c if split else None)
        before = fdev.stats.copy()
        got = fdev.gemm(a, b, **kw)
        assert same_bits(got, host.reference_gemm(fdev.format(), a, b, **kw)), (fdev.name, built, kw)
        host_act = activation is not None and activation not in built
        delta = fdev.stats - before
        assert delta.host_activations == int(host_act), kw
        assert delta.host_quantized == expected_host_quantized(units, kw["input"], out, rounding, split, split,
                                                               host_act), kw
        requests = check_requests(fdev)
        last = [P.decode_gemm(f.payload) for f in requests if f.opcode == Op.GEMM][-1]
        if host_act:  # the sums with the bias, in bf16: all the activation reads
            assert last["activation"] == P.NO_ACTIVATION and last["out_format"] == OutFormat.BF16
        elif activation is not None:
            assert last["activation"] == FUNCTIONS.index(activation)


@pytest.mark.parametrize("m,k,n,ta,tb", [(60, 30, 20, True, False), (20, 110, 60, False, True), (49, 49, 49, True, True)])
def test_transposed_and_split_along_one_side_without_units(m, k, n, ta, tb):
    rng = np.random.default_rng(m * n + k)
    a, b = operands(rng, m, k, n, ta, tb)
    with open_functions((), "minimal") as d:
        for activation, out in [("gelu", "bfp"), ("leaky_relu", "bf16"), ("sigmoid", "fp32")]:
            kw = dict(input="fp32", out=out, rounding="stochastic", seed=(7, 8, 9), transpose_a=ta, transpose_b=tb,
                      bias=rng.standard_normal(n).astype(np.float32), activation=activation,
                      c=rng.standard_normal((m, n)).astype(np.float32))
            assert same_bits(d.gemm(a, b, **kw), host.reference_gemm(d.format(), a, b, **kw)), kw
            check_requests(d)
        assert d.stats.host_activations == 3


@pytest.mark.parametrize("m,n", [(10, 20), (60, 50)])
def test_c_alone_without_units(m, n):
    """K = 0: C read through the epilogue (READ without the activation, bf16), finished here."""
    rng = np.random.default_rng(m)
    a, b = np.zeros((m, 0), np.float32), np.zeros((0, n), np.float32)
    with open_functions(()) as d:
        for out in ("fp32", "bf16", "bfp"):
            kw = dict(c=rng.standard_normal((m, n)).astype(np.float32), bias=rng.standard_normal(n).astype(np.float32),
                      activation="tanh", out=out, rounding="stochastic", seed=9)
            assert same_bits(d.gemm(a, b, **kw), host.reference_gemm(d.format(), a, b, **kw))
            reads = [P.decode_read(f.payload) for f in check_requests(d) if f.opcode == Op.READ]
            assert reads and all(r["activation"] == P.NO_ACTIVATION and r["out_format"] == OutFormat.BF16
                                 for r in reads)
        assert d.stats.host_activations == 3 and d.stats.host_quantized == 1
        # An empty product computes nothing, and applies nothing.
        assert d.gemm(np.zeros((0, 4), np.float32), np.zeros((4, 3), np.float32), activation="gelu").shape == (0, 3)
        assert d.stats.host_activations == 3


def test_leaky_relu_uses_the_devices_shift():
    """The host applies leaky_relu with the slope the device was built with, as its unit would."""
    rng = np.random.default_rng(4)
    a, b = operands(rng, 60, 50, 70)
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    g = rng.integers(0, 1 << 16, x.size, dtype=np.uint32).astype(np.uint16)
    with open_device("full", leaky_shift=3) as full, open_functions((), leaky_shift=3) as bare:
        for out in ("fp32", "bf16", "bfp"):
            kw = dict(activation="leaky_relu", out=out, bias=rng.standard_normal(70).astype(np.float32))
            want = full.gemm(a, b, **kw)
            assert same_bits(bare.gemm(a, b, **kw), want)
            assert not same_bits(want, host.reference_gemm(full.format(), a, b, **kw))  # the default shift is 7
        assert same_bits(bare.activation("leaky_relu", x), full.activation("leaky_relu", x))
        assert same_bits(bare.gradient("leaky_relu", x, g), full.gradient("leaky_relu", x, g))
        assert bare.stats.host_activations == 5 and full.stats.host_activations == 0
        check_requests(bare)


@pytest.mark.parametrize("functions", list(FUNCTION_SETS))
def test_elementwise_on_the_host(functions):
    """activation() and gradient() without the unit: the full device's bits (every bf16
    pattern), counted; with the unit: on the device."""
    rng = np.random.default_rng(5)
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    g = bf16.to_dtype(rng.integers(0, 1 << 16, x.shape, dtype=np.uint32).astype(np.uint16))
    built = FUNCTION_SETS[functions]
    with open_device("full") as full, open_functions(built) as d:
        assert d.identity.functions == tuple(f for f in FUNCTIONS if f in built)
        want_count = 0
        for name in UNARY_FUNCTIONS:
            for what, args, unit in [("activation", (x,), name), ("gradient", (x, g), name + "_grad")]:
                if unit not in FUNCTIONS:
                    with pytest.raises(ValueError, match="no gradient unit"):
                        d.gradient(name, x, g)
                    continue
                before = d.stats.copy()
                got = getattr(d, what)(name, *args)
                assert same_bits(got, getattr(full, what)(name, *args)), (what, name)
                assert got.shape == x.shape
                delta = d.stats - before
                elementwise = [f for f in check_requests(d) if f.opcode == Op.ELEMENTWISE]
                if unit in built:
                    assert delta.host_activations == 0 and elementwise
                else:
                    want_count += 1
                    assert delta.host_activations == 1 and not elementwise and delta.frames_sent == 0
        assert d.stats.host_activations == want_count
        # float input (rounded to bf16 first), a scalar, an empty array: as the full device
        v = rng.standard_normal((3, 5)).astype(np.float32)
        for arg in (v, np.float32(-1.5) * np.ones(()), np.zeros((0, 4), np.float32)):
            assert same_bits(d.activation("gelu", arg), full.activation("gelu", arg))
            assert same_bits(d.gradient("tanh", arg, arg), full.gradient("tanh", arg, arg))
        with pytest.raises(ValueError, match="unknown activation 'softmax'"):
            d.activation("softmax", x)
        with pytest.raises(host.ShapeMismatch, match="g must have x's shape"):
            d.gradient("gelu", x, g[:3])
        check_requests(d)


def test_functions_option():
    for text, want in [("functions=", ()), ("functions=none", ()), ("functions=None", ()),
                       ("functions=relu", ("relu",)), ("functions=gelu+relu", ("relu", "gelu")),
                       ("functions=relu+relu_grad", ("relu", "relu_grad")), ("", FUNCTIONS)]:
        with host.open(f"emu:rows=4,cols=4,size=48,{text}") as d:
            assert d.identity.functions == want, text
    with pytest.raises(host.BackendError, match="unknown function 'softmax'"):
        host.open("emu:functions=softmax")


@pytest.mark.parametrize("functions", list(FUNCTION_SETS))
def test_device_refuses_functions_not_built(functions):
    """Why the fallback is needed: GEMM and READ with an activation not built, and an
    ELEMENTWISE of a function not built, are refused with BAD_DESCRIPTOR."""
    built = FUNCTION_SETS[functions]
    d = host.Device(LoopbackTransport(EmuDevice(CoreConfig(**SMALL, functions=built), max_payload=WHOLE)), retries=0)
    for code, name in enumerate(FUNCTIONS):
        ok = Status.OK if name in built else Status.BAD_DESCRIPTOR
        unary_ok = ok if name in UNARY_FUNCTIONS else Status.BAD_DESCRIPTOR
        assert refusal(d, Op.GEMM, P.encode_gemm(8, 8, 8, activation=code)) == unary_ok, name
        assert refusal(d, Op.READ, P.encode_read(8, 8, activation=code)) == unary_ok, name
        data = bytes(2 * 4 * (2 if name in GRADIENT_FUNCTIONS else 1))
        assert refusal(d, Op.ELEMENTWISE, P.encode_elementwise(code, data[:8], data[8:])) == ok, name
