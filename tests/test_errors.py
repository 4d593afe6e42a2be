"""The host driver's errors about its caller's arguments and about a device's identity: typed
(``TypeError``/``ValueError``, ``ProtocolError``), naming the argument or the field, and raised
before anything is sent."""

import dataclasses

import numpy as np
import pytest

import hbfp.host as host
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.transports import LoopbackTransport
from hbfp.contract import CoreConfig

from . import conftest

SMALL = CoreConfig(**conftest.SMALL)


@pytest.fixture
def dev():
    with host.open("emu") as d:
        d.info()  # IDENTIFY now, so that the frame counts below see only the call under test
        yield d


def operands(m=5, k=7, n=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


# ---- gradient(name, x, None) -------------------------------------------------------------


def test_gradient_without_g_is_refused_before_anything_is_sent(dev):
    x = np.linspace(-2, 2, 10, dtype=np.float32)
    sent = dev.stats.frames_sent
    with pytest.raises(TypeError, match=r"gradient\('relu', x, g\) needs g"):
        dev.gradient("relu", x, None)
    assert dev.stats.frames_sent == sent and dev.stats.retries == 0
    g = np.ones_like(x)
    assert dev.gradient("relu", x, g).shape == x.shape  # with a g it works


def test_gradient_and_activation_names_are_checked(dev):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="no gradient unit for 'nosuch'"):
        dev.gradient("nosuch", x, x)
    with pytest.raises(ValueError, match="unknown activation"):
        dev.activation(["relu"], x)


def test_elementwise_operand_that_is_not_an_array(dev):
    with pytest.raises(TypeError, match="x must be .* got None"):
        dev.activation("relu", None)
    with pytest.raises(TypeError, match="g must be .* got a generator"):
        dev.gradient("relu", np.ones(3, np.float32), (v for v in (1.0, 2.0, 3.0)))


# ---- gemm operands ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, kind", [
    (None, "got None"),
    ("1 2; 3 4", "got a str"),
    ({"a": 1}, "got a dict"),
    ((r for r in [[1.0, 2.0], [3.0, 4.0]]), "got a generator"),
    (iter([[1.0, 2.0]]), "got a list_iterator"),
    ({1.0, 2.0}, "got a set"),
    (b"\x00\x01", "got a bytes"),
    ([[1.0, 2.0], [3.0]], "not a rectangular array"),
    ([[1.0, None], [3.0, 4.0]], "Python objects"),
])
@pytest.mark.parametrize("which", ["a", "b"])
def test_gemm_operand_that_is_not_an_array(dev, bad, kind, which):
    a, b = operands(k=2, n=2)
    args = (bad, b) if which == "a" else (a, bad)
    sent = dev.stats.frames_sent
    with pytest.raises(TypeError, match=rf"^{which} must be a NumPy array, a nested list of numbers, .*{kind}"):
        dev.gemm(*args)
    with pytest.raises(TypeError, match=rf"^{which} must be"):
        host.reference_gemm(dev.format(), *args)
    assert dev.stats.frames_sent == sent


def test_gemm_of_nested_lists_is_the_gemm_of_the_arrays(dev):
    a, b = operands()
    got = dev.gemm(a.tolist(), tuple(map(tuple, b.tolist())))
    assert np.array_equal(got.view(np.uint32), dev.gemm(a, b).view(np.uint32))


def test_bias_that_is_not_an_array(dev):
    a, b = operands()
    with pytest.raises(TypeError, match="^bias must be"):
        dev.gemm(a, b, bias=(v for v in range(3)))


# ---- seeds -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1.5, 2.0, "3", True, np.float32(1), (1, 2.0, 3), (1, 2, None)])
def test_non_integer_seed_is_refused(dev, seed):
    a, b = operands()
    sent = dev.stats.frames_sent
    with pytest.raises(TypeError, match="seed must be an integer"):
        dev.gemm(a, b, rounding="stochastic", seed=seed)
    with pytest.raises(TypeError, match="seed must be an integer"):
        host.reference_gemm(dev.format(), a, b, rounding="stochastic", seed=seed)
    assert dev.stats.frames_sent == sent


def test_integer_seeds_of_any_integer_type(dev):
    a, b = operands()
    want = dev.gemm(a, b, rounding="stochastic", seed=7, input="fp32")
    for seed in (np.int64(7), np.uint32(7), (7, 8, 9), [np.int16(7), 8, 9]):
        got = dev.gemm(a, b, rounding="stochastic", seed=seed, input="fp32")
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), seed
    with pytest.raises(ValueError, match="three"):
        dev.gemm(a, b, rounding="stochastic", seed=(1, 2))


# ---- a device's identity ------------------------------------------------------------------


class ChangedIdentity:
    """A byte device: ``emu`` whose IDENTIFY reply reports ``fields`` changed (framed again,
    with a good CRC, as a device with that bug would send it)."""

    def __init__(self, **fields):
        self.emu = EmuDevice(SMALL)
        self.fields = fields
        self.parser = P.FrameParser()

    def write(self, data: bytes) -> None:
        self.emu.write(data)

    def read(self, max_bytes=None) -> bytes:
        out = b""
        for frame in self.parser.feed(self.emu.read()):
            assert isinstance(frame, P.Frame)
            if frame.opcode == P.Op.IDENTIFY | P.REPLY and frame.status == P.Status.OK:
                ident = dataclasses.replace(P.decode_identity(frame.payload[1:]), **self.fields)
                out += P.encode_reply(P.Op.IDENTIFY, frame.tag, P.Status.OK, P.encode_identity(ident))
            else:
                out += P.encode_frame(frame.opcode, frame.tag, frame.payload)
        return out


def changed(check=True, **fields) -> host.Device:
    return host.Device(LoopbackTransport(ChangedIdentity(**fields)), retries=0, check=check, name="fake")


def test_the_fake_device_is_a_good_device_when_nothing_changes():
    dev = changed()
    assert dev.info().size == 48
    a, b = operands()
    got = dev.gemm(a, b)
    assert np.array_equal(got.view(np.uint32), host.reference_gemm(dev.format(), a, b).view(np.uint32))


@pytest.mark.parametrize("fields, match", [
    (dict(rows=0), "rows = 0"),
    (dict(cols=0), "cols = 0"),
    (dict(size=0), "size = 0"),
    (dict(tile_rows=0), "tile_rows = 0"),
    (dict(tile_cols=0), "tile_cols = 0"),
    (dict(stream_bytes=0), "stream_bytes = 0"),
    (dict(mantissa_bits=0), "mantissa_bits = 0"),
    (dict(mantissa_bits=17), "mantissa_bits = 17"),
    (dict(max_payload=0), "max_payload = 0"),
    (dict(size=50), "size = 50 is not a multiple of tile_rows = 24"),
    (dict(rows=5), "size = 48 is not a multiple of rows = 5"),
    (dict(cols=96), "size = 48 is not a multiple of cols = 96"),
])
def test_a_bad_identity_is_a_protocol_error_naming_the_field(fields, match):
    with pytest.raises(host.ProtocolError, match=f"^fake reported an .*identity.*: {match}"):
        changed(**fields)  # opening the device asks its identity
    dev = changed(check=False, **fields)
    with pytest.raises(host.ProtocolError, match=match):
        dev.info()
    a, b = operands()
    with pytest.raises(host.ProtocolError, match=match):  # not a ZeroDivisionError in the tiling
        dev.gemm(a, b)
    with pytest.raises(host.ProtocolError, match=match):
        dev.activation("relu", np.ones(3, np.float32))
