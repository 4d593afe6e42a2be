"""The driver's recovery from a damaged link, on the ``emu`` device: corrupted, truncated,
duplicated and dropped bytes, and a device that stops answering."""

import time

import numpy as np
import pytest

import hbfp.host as host
from hbfp.golden.compare import same_bits
from hbfp.host import protocol as P
from hbfp.host.emu import EmuDevice
from hbfp.host.transports import FaultyTransport, LoopbackTransport
from hbfp.contract import CoreConfig

CFG = CoreConfig(rows=4, cols=4, size=48)


def make(**kw):
    emu = EmuDevice(CFG, frame_timeout=1000)
    link = FaultyTransport(LoopbackTransport(emu), seed=kw.pop("seed", 0))
    return emu, link, host.Device(link, **kw)


def product(dev, seed=0, **kw):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((60, 110)).astype(np.float32)  # 2 x 3 blocks, 3 K chunks on 48x48 buffers
    b = rng.standard_normal((110, 70)).astype(np.float32)
    got = dev.gemm(a, b, **kw)
    assert same_bits(got, host.reference_gemm(dev.format(), a, b, **kw))


def test_corrupted_frame_gets_bad_crc_and_is_resent():
    emu, link, dev = make()
    link.corrupt_next = 1
    st = dev.status()  # STATUS has no payload: the flip goes to the CRC
    assert dev.stats.retries == 1
    assert st.last_error == P.Status.BAD_CRC and st.refused == 1
    link.corrupt_next = 3
    product(dev, out="bf16")
    assert dev.stats.retries >= 2  # frames of one chain fail together: one restart each time


def test_truncated_frame_times_out_on_the_device_and_the_next_command_works():
    emu, link, dev = make()
    link.truncate_next = 1
    ident = dev.info()  # the device replies TIMEOUT after frame_timeout idle cycles
    assert ident.size == 48 and dev.stats.retries == 1
    assert dev.status().last_error == P.Status.TIMEOUT
    link.truncate_next = 2  # two frames in a row: the first swallows the second
    product(dev, c=np.ones((60, 70), np.float32))
    assert dev.stats.retries >= 2


def test_duplicated_frames_stale_replies_are_ignored():
    emu, link, dev = make()
    link.duplicate_next = 1
    dev.status()
    assert dev.stats.stale_replies == 0
    dev.info()  # the duplicate's reply arrives first while waiting: stale, ignored
    assert dev.stats.stale_replies == 1 and dev.stats.retries == 0


def test_duplicated_accumulating_product_restarts_its_chain():
    emu, link, dev = make()
    sent = []
    real = link.send

    def send(data):
        # Duplicate the first accumulating GEMM: it would add its product twice.
        op, payload = data[3], data[P.HEADER.size : -P.CRC_SIZE]
        if op == P.Op.GEMM and P.decode_gemm(payload)["flags"] & P.GEMM_FLAGS["accumulate"] and not sent:
            sent.append(1)
            link.duplicate_next = 1
        real(data)

    link.send = send
    product(dev)
    assert sent and dev.stats.retries == 1


@pytest.mark.parametrize("seed", [1, 2])
def test_a_link_that_drops_bytes(seed):
    emu, link, dev = make(seed=seed, retries=30)
    link.drop = 2e-5  # each byte; a full 48x48 fp32 reply is ~9 kB
    link.drop_received = 2e-5
    for i in range(3):
        try:
            product(dev, seed=i, out="bfp", input="fp32")
        except host.LinkError as e:  # allowed: a clear error, never a wrong result
            assert "CRC" in str(e) or "reply" in str(e) or "truncated" in str(e)
    assert dev.stats.retries > 0
    link.drop = link.drop_received = 0
    product(dev)


def test_a_device_that_stops_answering_times_out_then_recovers():
    emu, link, dev = make(timeout=0.2, retries=2)
    link.mute = True
    t0 = time.monotonic()
    with pytest.raises(host.Timeout, match="no reply"):
        dev.status()
    assert time.monotonic() - t0 < 0.2 * 3 + 0.5
    link.mute = False
    assert dev.info().size == 48
    product(dev)


def test_retries_are_bounded():
    emu, link, dev = make(retries=2)
    link.corrupt_next = 10
    with pytest.raises(host.CrcError, match="bad CRC"):
        dev.info()
    assert dev.stats.retries == 2


def test_device_errors_are_not_retried():
    emu, link, dev = make()
    with pytest.raises(host.DeviceError) as e:
        dev.command(P.Op.GEMM, P.encode_gemm(0, 4, 4))
    assert e.value.status == P.Status.BAD_DESCRIPTOR and dev.stats.retries == 0
