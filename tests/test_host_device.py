"""The host driver on the ``emu`` device: every product equals the golden model on the whole
problem, tiled or not; elementwise units; DLPack; errors; backends; statistics."""

import importlib.metadata

import ml_dtypes
import numpy as np
import pytest

import hbfp.host as host
from hbfp.golden import activations, bf16
from hbfp.golden.bfp import quantize
from hbfp.golden.compare import same_bits
from hbfp.host import protocol as P
from hbfp.host import registry
from hbfp.host.emu import EmuDevice
from hbfp.host.transports import LoopbackTransport
from hbfp.contract import CoreConfig


def operands(rng, m, k, n, transpose_a=False, transpose_b=False, scale=1.0):
    a = (rng.standard_normal((k, m) if transpose_a else (m, k)) * scale).astype(np.float32)
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    return a, b


def check(dev, a, b, **kw):
    got = dev.gemm(a, b, **kw)
    want = host.reference_gemm(dev.format(), a, b, **kw)
    assert same_bits(got, want), kw
    return got


#: emu's two ways to run a product: computed whole in-process (the default) and through the
#: wire protocol and the driver's tiling (``wire=1``); both must equal the reference.
PATHS = {"direct": "wire=0", "wire": "wire=1"}


@pytest.fixture(scope="module", params=list(PATHS))
def dev(request):
    with host.open(f"emu:{PATHS[request.param]}") as d:
        yield d


@pytest.fixture(scope="module", params=list(PATHS))
def small(request):
    # 4x4 array, 48x48 buffers: everything above 48 is tiled. A payload buffer for a whole
    # buffer of fp32 values, so that an operand of one block travels in one WRITE.
    with host.open(f"emu:rows=4,cols=4,size=48,max_payload={P.WRITE_HEADER + 4 * 48 * 48},"
                   f"{PATHS[request.param]}") as d:
        yield d


SHAPES = [(1, 1, 1), (7, 13, 5), (48, 48, 48), (49, 97, 50), (100, 31, 130), (61, 150, 23)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("out", ["fp32", "bf16", "bfp"])
def test_products_equal_golden(small, m, k, n, out):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a, b = operands(rng, m, k, n)
    check(small, a, b, out=out)


@pytest.mark.parametrize("input", ["codes", "fp32", "bf16"])
@pytest.mark.parametrize("rounding", ["nearest_even", "toward_zero", "stochastic"])
@pytest.mark.parametrize("m,k,n", [(30, 40, 20), (100, 110, 70)])
def test_inputs_and_roundings(small, input, rounding, m, k, n):
    rng = np.random.default_rng(7)
    ta, tb = bool(m % 3), bool(n % 3)
    a, b = operands(rng, m, k, n, ta, tb)
    before = small.stats.host_quantized
    check(small, a, b, input=input, rounding=rounding, seed=11, out="bfp", transpose_a=ta, transpose_b=tb)
    if rounding == "stochastic" and m > 48:
        assert small.stats.host_quantized > before  # split operands: positions kept by the host
    elif input != "codes":
        assert small.stats.host_quantized == before


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False), (False, True), (True, True)])
def test_everything_at_once(small, transpose_a, transpose_b):
    rng = np.random.default_rng(3)
    m, k, n = 70, 130, 55
    a, b = operands(rng, m, k, n, transpose_a, transpose_b, scale=4.0)
    bias = rng.standard_normal(n).astype(np.float32)
    c = rng.standard_normal((m, n)).astype(np.float32)
    for out, act in (("fp32", "gelu"), ("bf16", "leaky_relu"), ("bfp", "tanh")):
        check(small, a, b, bias=bias, c=c, activation=act, out=out, transpose_a=transpose_a,
              transpose_b=transpose_b)


def test_special_values_and_bf16_operands(dev):
    rng = np.random.default_rng(4)
    a, b = operands(rng, 100, 200, 120)
    a[3, 5], a[50, 150], b[7, 9] = np.inf, np.nan, -np.inf
    check(dev, a, b)
    a16 = bf16.to_dtype(bf16.from_f32(a))
    check(dev, a16, b, input="fp32")
    check(dev, a16, b, input="bf16", out="bf16")


def test_bfp_tensors_as_operands_and_k_zero(dev):
    rng = np.random.default_rng(5)
    a, b = operands(rng, 40, 100, 30)
    fmt = dev.format()
    qa, qb = quantize(a, fmt), quantize(b, fmt)
    assert same_bits(dev.gemm(qa, qb), host.reference_gemm(fmt, qa, qb))
    c = rng.standard_normal((40, 30)).astype(np.float32)
    bias = rng.standard_normal(30).astype(np.float32)
    empty_a, empty_b = np.zeros((40, 0), np.float32), np.zeros((0, 30), np.float32)
    check(dev, empty_a, empty_b, c=c, bias=bias, activation="relu")
    assert same_bits(dev.gemm(empty_a, empty_b), np.zeros((40, 30), np.float32))
    assert dev.gemm(np.zeros((0, 5), np.float32), np.zeros((5, 3), np.float32)).shape == (0, 3)


def test_k_zero_tiled(small):
    rng = np.random.default_rng(13)
    c = rng.standard_normal((100, 70)).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    for out in ("fp32", "bfp"):
        check(small, np.zeros((100, 0), np.float32), np.zeros((0, 70), np.float32), c=c, bias=bias, out=out,
              activation="sigmoid")


def test_other_formats():
    rng = np.random.default_rng(6)
    with host.open("emu:format=HBFP16,rows=4,cols=4,size=48") as d16:
        a, b = operands(rng, 50, 60, 70)
        check(d16, a, b, out="bfp", input="fp32")
    with host.open("emu:format=MXINT8,rows=4,cols=4,size=64") as mx:
        a, b = operands(rng, 20, 100, 70, transpose_b=True)
        check(mx, a, b, transpose_b=True, out="bfp", input="bf16")
        with pytest.raises(host.NotSupported, match="not square"):
            mx.gemm(a, b.T)


def test_small_max_payload_and_no_pipeline():
    rng = np.random.default_rng(8)
    a, b = operands(rng, 60, 70, 50)
    # One fp32 tile of values (24 x 24 x 4 bytes) fits, a row of them does not.
    dev = host.Device(LoopbackTransport(EmuDevice(CoreConfig(rows=4, cols=4, size=48), max_payload=2400, wire=True)),
                      pipeline=False)
    check(dev, a, b, input="fp32", bias=rng.standard_normal(50).astype(np.float32))
    check(dev, a, b, input="bf16", rounding="stochastic", seed=3)
    check(dev, a, b)
    tiny = host.Device(LoopbackTransport(EmuDevice(CoreConfig(rows=4, cols=4, size=48), max_payload=200, wire=True)))
    check(tiny, a, b)
    with pytest.raises(host.NotSupported, match="too small"):
        tiny.gemm(a, b, input="fp32")
    x = bf16.from_f32(rng.standard_normal(500).astype(np.float32))
    assert np.array_equal(dev.activation("sigmoid", x).view(np.uint16), activations.sigmoid(x))


def test_elementwise(dev):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((7, 33)).astype(np.float32) * 3
    g = rng.standard_normal((7, 33)).astype(np.float32)
    xb, gb = bf16.from_f32(x), bf16.from_f32(g)
    for name in ("relu", "gelu", "exp"):
        y = dev.activation(name, bf16.to_dtype(xb))
        assert y.dtype == ml_dtypes.bfloat16 and y.shape == (7, 33)
        assert np.array_equal(y.view(np.uint16), activations.get(name)(xb))
    y = dev.gradient("sigmoid", x, g)  # fp32 in: rounded to bf16 first
    assert np.array_equal(y.view(np.uint16), activations.sigmoid_grad(xb, gb))
    with pytest.raises(host.ShapeMismatch):
        dev.gradient("tanh", x, g[:3])
    with pytest.raises(ValueError, match="unknown activation"):
        dev.activation("softmax", x)


class Producer:
    """A minimal ``__dlpack__`` producer (what a PyTorch tensor offers)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_inputs(dev):
    rng = np.random.default_rng(10)
    a, b = operands(rng, 30, 40, 50)
    got = dev.gemm(Producer(a), Producer(b), bias=Producer(np.ones(50, np.float32)))
    assert same_bits(got, host.reference_gemm(dev.format(), a, b, bias=np.ones(50, np.float32)))
    # NumPy cannot export an ml_dtypes.bfloat16 array over DLPack: a clear error.
    with pytest.raises(host.NotSupported, match="cannot import the tensor through DLPack"):
        dev.gemm(Producer(a.astype(ml_dtypes.bfloat16)), b)


def test_torch_bf16_tensors_cross_through_dlpack(dev):
    import torch

    rng = np.random.default_rng(12)
    a, b = operands(rng, 20, 30, 40)
    ta, tb = torch.from_numpy(a).to(torch.bfloat16), torch.from_numpy(b).to(torch.bfloat16)
    got = dev.gemm(ta, tb.t(), transpose_b=True, input="bf16")  # a strided (transposed) bf16 view
    want = dev.gemm(a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16), input="bf16")
    assert same_bits(got, want)


def test_argument_errors(dev):
    a, b = np.ones((4, 5), np.float32), np.ones((6, 7), np.float32)
    with pytest.raises(host.ShapeMismatch, match="does not agree along K"):
        dev.gemm(a, b)
    with pytest.raises(host.ShapeMismatch, match="bias"):
        dev.gemm(a, b.T[:5], bias=np.ones(3, np.float32))
    with pytest.raises(host.ShapeMismatch, match="matrix"):
        dev.gemm(np.ones(5, np.float32), b)
    with pytest.raises(ValueError, match="seed"):
        dev.gemm(a, np.ones((5, 2), np.float32), rounding="stochastic")
    with pytest.raises(ValueError, match="out must be"):
        dev.gemm(a, np.ones((5, 2), np.float32), out="int8")
    with pytest.raises(TypeError, match="dtype"):
        dev.gemm(a.astype(bool), np.ones((5, 2), np.float32))
    with pytest.raises(host.NotSupported, match="16-bit codes"):
        dev.gemm(quantize(a, host.protocol.Identity(*[1] * 6, 16, 24, 24, 7, 96, 0, 0, 0, 0).fmt()),
                 np.ones((5, 2), np.float32))
    with host.open("emu:functions=relu") as d:
        with pytest.raises(ValueError, match="unknown activation 'softmax'"):
            d.gemm(a, np.ones((5, 2), np.float32), activation="softmax")
        # No gelu unit: applied on the host (tests/test_host_reduced.py), not refused.
        check(d, a, np.ones((5, 2), np.float32), activation="gelu")
        assert d.stats.host_activations == 1


def test_stats_and_bytes_per_mac():
    dev = host.open("emu:wire=1")
    rng = np.random.default_rng(12)
    a, b = operands(rng, 96, 96, 96)
    per_mac = {}
    for input in ("codes", "bf16", "fp32"):
        dev.reset_stats()
        check(dev, a, b, input=input)
        st = dev.stats
        assert st.macs == 96**3 and st.cycles > 96**3 // 64 and st.retries == 0
        assert st.link_bytes == st.bytes_sent + st.bytes_received
        per_mac[input] = st.bytes_per_mac
    # codes: 1 byte an element each way in, fp32 out; values: 2 or 4 bytes an element in
    assert per_mac["codes"] < per_mac["bf16"] < per_mac["fp32"]
    assert per_mac["codes"] == pytest.approx((2 * 96 * 96 + 4 * 96 * 96) / 96**3, rel=0.02)
    st = dev.status()
    assert st.refused == 0 and st.accepted > 0


def test_info_status_reset(dev):
    ident = dev.info()
    assert ident.abi_major == host.protocol.ABI_VERSION[0] and ident.size == 96 and dev.identity == ident
    dev.reset()
    assert dev.status().accepted == 1  # STATUS counts itself
    assert "emu" in repr(dev)


def test_abi_mismatch_refused():
    with pytest.raises(host.AbiMismatch, match=r"ABI 2\.0.*ABI 1\.1"):
        host.Device(LoopbackTransport(EmuDevice(abi_version=(2, 0))))
    host.Device(LoopbackTransport(EmuDevice(abi_version=(1, 7))))  # a newer minor is fine
    host.Device(LoopbackTransport(EmuDevice(abi_version=(1, 0))))  # and an older one


class _OldBackend:
    ABI_VERSION = (0, 9)

    def open(self, arg, **options):
        return EmuDevice()


def test_backends_listed_and_broken_ones_reported(monkeypatch):
    real = registry._entry_points()
    broken = importlib.metadata.EntryPoint("broken", "hbfp_no_such_module:backend", registry.GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: real + [broken])
    monkeypatch.setattr(registry, "_registered", {"old": _OldBackend()})
    found = host.backends()
    for name in ("emu", "tcp", "serial"):
        assert found[name].ok and found[name].abi == host.protocol.ABI_VERSION, found[name]
    assert "sim" in found  # reported either way (it is another package's)
    assert not found["broken"].ok and "hbfp_no_such_module" in found["broken"].error
    assert not found["old"].ok and "AbiMismatch" in found["old"].error
    with pytest.raises(host.BackendError, match="failed to load.*hbfp_no_such_module"):
        host.open("broken")
    with pytest.raises(host.AbiMismatch, match="backend 'old'"):
        host.open("old")
    with pytest.raises(host.BackendError, match="no device backend 'nope'"):
        host.open("nope:1")
    with pytest.raises(host.BackendError, match="unknown emu option"):
        host.open("emu:colour=blue")
    monkeypatch.setattr(registry, "_registered", {})
    host.register_backend("mine", registry.load_backend("emu"))
    assert host.backends()["mine"].ok
    with host.open("mine:size=48,rows=4,cols=4") as d:
        assert d.identity.size == 48


@pytest.mark.parametrize("spec", ["rows=4,cols=4,size=48", "rows=4,cols=4,size=64,format=MXINT8",
                                  "rows=2,cols=2,size=24,functions=none,value_quantizer=0,bfp_output=0,stochastic=0",
                                  "rows=8,cols=4,size=48,tile=12x12,leaky_shift=3,out_lanes=2"])
def test_direct_products_equal_the_wire_and_count_the_same_cycles(spec):
    """The in-process path gives the wire path's results bit for bit and counts the cycles, MACs
    and host work that the device's commands report: tiled, K chunks, every output and rounding,
    values and codes, bias, C, activations (on the host for a device without the unit)."""
    direct, wire = host.open(f"emu:{spec}"), host.open(f"emu:{spec},wire=1")
    assert direct.in_process and not wire.in_process
    rng = np.random.default_rng(len(spec))
    square = direct.identity.square
    for i, (m, k, n) in enumerate([(50, 130, 70), (24, 24, 24), (97, 5, 49), (30, 0, 20)]):
        for out in ("fp32", "bf16", "bfp"):
            for rounding, input in (("nearest_even", "codes"), ("stochastic", "fp32"), ("toward_zero", "bf16")):
                tb = not square or bool(i % 2)
                a, b = operands(rng, m, k, n, transpose_b=tb)
                kw = dict(out=out, rounding=rounding, input=input, seed=i, transpose_b=tb,
                          activation=("leaky_relu", "gelu", None)[i % 3], bias=rng.standard_normal(n).astype(np.float32),
                          c=rng.standard_normal((m, n)).astype(np.float32) if i % 2 else None)
                before = direct.stats.copy(), wire.stats.copy()
                assert same_bits(direct.gemm(a, b, **kw), wire.gemm(a, b, **kw)), kw
                d, w = direct.stats - before[0], wire.stats - before[1]
                for name in ("cycles", "macs", "host_quantized", "host_activations"):
                    assert getattr(d, name) == getattr(w, name), (name, kw)
                assert d.bytes_sent == 0 and w.bytes_sent > 0


@pytest.mark.parametrize("spec", ["rows=4,cols=4,size=48", "rows=4,cols=4,size=48,functions=relu",
                                  "rows=4,cols=4,size=64,format=MXINT8"])
def test_gemm_tensors_equal_gemm(spec):
    """Device.gemm_tensors (torch tensors, hbfp.kernels) gives gemm's bits and counts
    its cycles and host work: transposes, C, bias, an activation (on the host where the device
    has no unit), fp32 and bf16 out, tensors or codes."""
    import torch

    from hbfp import kernels

    dev = host.open(f"emu:{spec}")
    square = dev.identity.square
    rng = np.random.default_rng(21)
    for i, (m, k, n) in enumerate([(50, 130, 70), (7, 5, 3), (96, 100, 33)]):
        ta, tb = (bool(i % 2) and square), (not square or i != 1)
        a, b = operands(rng, m, k, n, ta, tb)
        c, bias = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        for out, act in (("fp32", None), ("bf16", "gelu"), ("fp32", "sigmoid")):
            kw = dict(transpose_a=ta, transpose_b=tb, out=out, activation=act)
            before = dev.stats.copy()
            want = dev.gemm(a, b, c=c, bias=bias, **kw)
            mid = dev.stats.copy()
            qb = kernels.quantize(torch.from_numpy(b), dev.format())
            got = dev.gemm_tensors(torch.from_numpy(a), qb, c=torch.from_numpy(c), bias=torch.from_numpy(bias), **kw)
            after = dev.stats
            assert got.dtype == (torch.bfloat16 if out == "bf16" else torch.float32)
            bits = got.view(torch.int16).numpy() if out == "bf16" else got.numpy()
            assert same_bits(bits.view(np.uint16) if out == "bf16" else bits,
                             want.view(np.uint16) if out == "bf16" else want), (spec, i, kw)
            for name in ("cycles", "macs", "host_activations"):
                assert getattr(after - mid, name) == getattr(mid - before, name), (name, spec, kw)
    with pytest.raises(host.NotSupported, match="through its link"):
        host.open("emu:wire=1").gemm_tensors(torch.ones(2, 2), torch.ones(2, 2))
