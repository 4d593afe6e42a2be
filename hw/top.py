"""The accelerator top: the wire protocol (docs/protocol.md) on a byte stream, around the
GEMM core.

```
 i (N lanes) -> BeatCompactor -> ByteWindow -> PacketEngine -> ChunkToBeat -> o (N lanes)
                                                |   |   |  \\
                                    w, cmd, result  |   |   ELEMENTWISE: Activation (1 lane)
                                          GemmCore  |   WRITE of values: Quantize (value_lanes)
                                                    payload buffer (two slots of max_payload bytes, N-byte words)
```
"""

from __future__ import annotations

from amaranth import Module
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from hbfp.contract import DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_PAYLOAD

from .activation import Activation
from .gemm_core import GemmCore
from .link import BeatCompactor, ByteWindow, ChunkToBeat, StreamRegister, beat_layout
from .packet import PacketEngine, value_lanes
from .params import CoreConfig
from .quantize import Quantize

__all__ = ["AcceleratorTop", "DEFAULT_MAX_PAYLOAD", "DEFAULT_FRAME_TIMEOUT"]

# The defaults are the contract's, so emu and the gateware agree: a 4 KiB payload (the host
# splits larger WRITEs; the buffer holds two, one arriving while the other executes) and a frame timeout of 2^20 cycles (about 10 ms at
# 100 MHz, over a hundred bytes' time of a 115200-baud UART).


class AcceleratorTop(wiring.Component):
    """The whole device: packet engine, ``GemmCore(cfg)``, an input quantizer (unless
    ``cfg.value_quantizer`` is False) and a bf16 activation unit, behind two byte streams.

    Ports: ``i`` (in) and ``o`` (out), streams of ``beat_layout(stream_bytes)``: ``data``
    lanes of one byte, lane 0 first on the wire, and ``keep`` (bit b: lane b holds a byte).
    Any ``keep`` pattern is accepted on ``i`` (an empty one is a null beat); on ``o`` the
    kept lanes are always the first ones, and a reply's last beat is sent at once, partly
    filled if need be.

    Parameters: ``cfg`` (the core: any array shape against any tile; WRITEs of A's codes go
    in row chunks of ``rows`` codes, of B's codes, the accumulator and the bias of ``cols``
    elements, and the input quantizer's beats of ``value_lanes(cfg, stream_bytes)`` values, a
    divisor of the tile's columns that fits both and takes the link's bytes of a cycle, as
    partial row chunks), ``stream_bytes`` (1 ..
    255, the width of ``i`` and ``o``), ``clock_hz`` (reported by IDENTIFY; 0: unknown),
    ``max_payload`` (bytes of a request's payload, 32 .. 2**24; the payload buffer holds two),
    ``frame_timeout`` (cycles).

    Throughput: ``stream_bytes`` (N) bytes a cycle each way in a frame's payload (a request's
    data into the payload buffer; a reply's result out as fast as the core gives it, up to
    N); headers and CRCs a byte a cycle in, N a beat out. A reply's beats are full but for
    its header's, its CRC's and its payload's last (docs/protocol.md, "Throughput").
    """

    def __init__(self, cfg: CoreConfig = CoreConfig(), *, stream_bytes: int = 1, clock_hz: int = 0,
                 frame_timeout: int = DEFAULT_FRAME_TIMEOUT, max_payload: int = DEFAULT_MAX_PAYLOAD):
        try:
            self._check(cfg, stream_bytes, clock_hz, frame_timeout, max_payload)
        except (ValueError, TypeError):
            self._MustUse__used = True  # never meant to be elaborated
            raise
        self.cfg = cfg
        self.stream_bytes = stream_bytes
        self.clock_hz = clock_hz
        self.frame_timeout = frame_timeout
        self.max_payload = max_payload
        super().__init__({
            "i": In(stream.Signature(beat_layout(stream_bytes))),
            "o": Out(stream.Signature(beat_layout(stream_bytes))),
        })

    @staticmethod
    def _check(cfg, stream_bytes, clock_hz, frame_timeout, max_payload):
        if not isinstance(cfg, CoreConfig):
            raise TypeError(f"cfg must be a CoreConfig, got {cfg!r}")
        # Every CoreConfig (its own rules checked) makes a top: any array shape, any tile.
        for name, value, lo, hi in (("stream_bytes", stream_bytes, 1, 255), ("clock_hz", clock_hz, 0, 2**32 - 1),
                                    ("frame_timeout", frame_timeout, 2, 2**32 - 1), ("max_payload", max_payload, 32, 2**24)):
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in {lo} .. {hi}, got {value!r}")

    def elaborate(self, platform):
        m = Module()
        cfg = self.cfg
        N = self.stream_bytes
        m.submodules.compactor = compactor = BeatCompactor(N)
        # Frames start at any byte of a beat: the window realigns them for the engine, which
        # takes 1 byte a cycle (hunt, header, CRC) or N (payload). Wires for N = 1.
        m.submodules.window = window = ByteWindow(N, N)
        m.submodules.engine = engine = PacketEngine(
            cfg, stream_bytes=N, clock_hz=self.clock_hz,
            max_payload=self.max_payload, frame_timeout=self.frame_timeout)
        m.submodules.to_beat = to_beat = ChunkToBeat(N)
        m.submodules.core = core = GemmCore(cfg)

        wiring.connect(m, wiring.flipped(self.i), compactor.i)
        wiring.connect(m, compactor.o, window.i)
        wiring.connect(m, window.o, engine.i)
        wiring.connect(m, engine.o, to_beat.i)
        wiring.connect(m, to_beat.o, wiring.flipped(self.o))

        def registered(name, source, sink, **kw):
            """``source`` to ``sink`` through a ``StreamRegister``: the units lie apart on a
            large FPGA, and their handshakes, each a few levels of logic, are not to add up
            across the die in one cycle."""
            m.submodules[name] = reg = StreamRegister(source.payload.shape(), **kw)
            wiring.connect(m, source, reg.i)
            wiring.connect(m, reg.o, sink)

        # The core's cycles and results do not move: it counts from its own acceptance of a
        # command to its own last output beat, which the engine sees a cycle later.
        # Where a ready enables many flip-flops, or comes through a unit's logic, it stops at a
        # skid buffer: the core's w ready enables the engine's write replay (some 500
        # flip-flops 16x16), and the engine's ready (the serializer's, the reply window's)
        # reached through the core's output quantizer.
        registered("w_register", engine.w, core.w, registered_ready=True)
        registered("cmd_register", engine.cmd, core.cmd)
        registered("result_register", core.o, engine.result, registered_ready=True)
        m.d.comb += engine.core_cycles.eq(core.cycles)

        # Without the value quantizer the engine refuses WRITEs of values: q_i and q_o stay idle.
        if cfg.value_quantizer:
            m.submodules.quantize = qz = Quantize(cfg.mantissa_bits, cfg.tile, value_lanes(cfg, N), "fp32",
                                                  stochastic=cfg.stochastic)
            # The quantizer's ready (from its bank state) stops at a register too.
            registered("q_i_register", engine.q_i, qz.i, registered_ready=True)
            registered("q_o_register", qz.o, engine.q_o, registered_ready=True)
            m.d.comb += [qz.rounding.eq(engine.q_rounding), qz.seed.eq(engine.q_seed), qz.clear.eq(engine.q_clear)]

        # Without activation units the engine refuses ELEMENTWISE: act_i and act_o stay idle.
        if cfg.built_functions:
            m.submodules.activation = act = Activation(functions=cfg.built_functions, leaky_shift=cfg.leaky_shift)
            # Its ready (the reply's, a cycle on) stops at a register before the engine's
            # windows, whose shift it would otherwise drive across the die.
            registered("act_i_register", engine.act_i, act.i, registered_ready=True)
            registered("act_o_register", act.o, engine.act_o, registered_ready=True)
        return m
