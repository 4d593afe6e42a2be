"""The clock domain crossing of streams (``hbfp.hw.crossing.AsyncStreamFifo``) in Amaranth's
simulator, its two sides on clocks of different periods (unrelated: 8 ns and 13.3 ns, either
way round; equal, in phase and not; nearly equal, drifting): a scoreboard under random
``valid`` and ``ready`` on both sides, the full and empty edges, latency and steady-state
throughput, and both domains' resets."""

import random

import pytest
from amaranth import ClockDomain, Elaboratable, Module
from amaranth.sim import Simulator

from hbfp.hw.crossing import AsyncStreamFifo

WIDTH = 16
NS = 1e-9

#: (write period, read period, read clock's phase), ns: unrelated periods either way round,
#: one clock in two domains, equal periods out of phase, and two clocks drifting past each
#: other (an RGMII receive clock against the link's own, both nominally 125 MHz).
CLOCKS = [(8.0, 13.3, None), (13.3, 8.0, None), (8.0, 8.0, None), (8.0, 8.0, 3.0), (8.0, 8.04, 1.0)]
CLOCK_IDS = ["8-13.3", "13.3-8", "8-8", "8-8+3", "8-8.04"]


def word(k: int) -> int:
    """The ``k``-th word sent (distinct for 2**16 consecutive ``k``: an odd multiplier)."""
    return (k * 0x9E3B + 0x1234) & 0xFFFF


class Harness(Elaboratable):
    """The FIFO between the domains ``write`` and ``read``, declared here so that a test can
    drive their resets."""

    def __init__(self, depth: int):
        self.fifo = AsyncStreamFifo(WIDTH, depth=depth, w_domain="write", r_domain="read")
        self.write, self.read = ClockDomain("write"), ClockDomain("read")

    def elaborate(self, platform):
        m = Module()
        m.domains += [self.write, self.read]
        m.submodules.fifo = self.fifo
        return m


def simulate(harness, w_period, r_period, r_phase, *testbenches):
    sim = Simulator(harness)
    sim.add_clock(w_period * NS, domain="write")
    sim.add_clock(r_period * NS, domain="read", phase=None if r_phase is None else r_phase * NS)
    for tb in testbenches:
        sim.add_testbench(tb)
    sim.run()


class Scoreboard:
    """A producer and a consumer on the FIFO's two sides: words ``word(k)`` in, offered with
    probability ``valid_p`` each write cycle (and withdrawn as often), taken with probability
    ``ready_p`` each read cycle; every word out must be the next one sent, and one the
    producer has already handed over; a word on offer stays until taken; nothing comes out
    after the last word. Records each side's cycle of each word (``sent_at``, ``got_at``)."""

    def __init__(self, harness, n, *, valid_p=1.0, ready_p=1.0, seed=0, max_cycles=None):
        self.harness, self.fifo, self.n, self.valid_p, self.ready_p = harness, harness.fifo, n, valid_p, ready_p
        self.rng_w, self.rng_r = random.Random(seed), random.Random(seed + 1)
        self.max_cycles = max_cycles or 40 * n + 1000
        self.sent = self.got = 0
        self.sent_at, self.got_at = [], []
        self.read_pause = lambda cycle: False  # read cycles the consumer holds off

    async def producer(self, ctx):
        i = self.fifo.i
        for cycle in range(self.max_cycles):
            if self.sent == self.n:
                ctx.set(i.valid, 0)
                return
            offer = self.rng_w.random() < self.valid_p
            ctx.set(i.valid, offer)
            ctx.set(i.payload, word(self.sent) if offer else 0xDEAD)
            if offer and ctx.get(i.ready):
                self.sent_at.append(cycle)
                self.sent += 1
            await ctx.tick("write")
        raise AssertionError(f"{self.sent} of {self.n} words taken by the FIFO in {self.max_cycles} cycles")

    async def consumer(self, ctx):
        o = self.fifo.o
        held = False
        for cycle in range(self.max_cycles):
            if self.got == self.n:
                break
            ready = not self.read_pause(cycle) and self.rng_r.random() < self.ready_p
            ctx.set(o.ready, ready)
            if ctx.get(o.valid):
                assert self.got < self.sent, f"o.valid with nothing sent (word {self.got}, read cycle {cycle})"
                got = ctx.get(o.payload)
                assert got == word(self.got), f"word {self.got}: {got:#06x}, expected {word(self.got):#06x}"
                if ready:
                    self.got_at.append(cycle)
                    self.got += 1
                held = not ready
            else:
                assert not held, f"word {self.got} withdrawn before it was taken (read cycle {cycle})"
            await ctx.posedge(self.harness.read.clk)  # (a tick would stop at the read domain's reset)
        else:
            raise AssertionError(f"{self.got} of {self.n} words out in {self.max_cycles} cycles")
        ctx.set(o.ready, 1)
        for _ in range(40):  # nothing more, however long one waits
            assert not ctx.get(o.valid), f"a word after the last ({ctx.get(o.payload):#06x})"
            await ctx.tick("read")


@pytest.mark.parametrize("depth", [8, 2])
@pytest.mark.parametrize("valid_p,ready_p", [(0.5, 0.5), (0.9, 0.3), (0.3, 0.9), (1.0, 0.95)])
@pytest.mark.parametrize("w_period,r_period,r_phase", CLOCKS, ids=CLOCK_IDS)
def test_every_word_once_in_order(w_period, r_period, r_phase, valid_p, ready_p, depth):
    """Under random valid and ready on both sides (a producer withdrawing its offers, too),
    thousands of words come through in order, none lost, none repeated, none made up: no
    ``o.valid`` while empty, and none after the last word."""
    h = Harness(depth)
    sb = Scoreboard(h, 2500, valid_p=valid_p, ready_p=ready_p,
                    seed=int(w_period * 10 + r_period * 100 + valid_p * 1000 + ready_p * 10000 + depth))
    simulate(h, w_period, r_period, r_phase, sb.producer, sb.consumer)
    assert sb.got == sb.sent == sb.n


@pytest.mark.parametrize("w_period,r_period,r_phase", CLOCKS[:3], ids=CLOCK_IDS[:3])
def test_full_and_empty_edges(w_period, r_period, r_phase):
    """Filled with the consumer stalled, the FIFO takes exactly ``depth + 1`` words (the memory
    and ``o``'s register) and then refuses, however long; a word taken frees exactly one slot;
    drained, ``o.valid`` falls after the last word and stays low, and a lone word then comes
    through. Several rounds, so that the pointers wrap. Within a cycle ``i.ready`` does not
    follow ``i.valid``, nor ``o.valid`` or ``o.payload`` follow ``o.ready`` (registers)."""
    depth = 4
    h = Harness(depth)
    fifo = h.fifo
    state = {"sent": 0, "got": 0, "phase": "fill", "done": False}

    async def producer(ctx):
        while not state["done"]:
            want = state["phase"] in ("fill", "lone") and state["sent"] < state.get("limit", 10**9)
            ctx.set(fifo.i.valid, want)
            ctx.set(fifo.i.payload, word(state["sent"]))
            ready = ctx.get(fifo.i.ready)
            ctx.set(fifo.i.valid, not want)
            assert ctx.get(fifo.i.ready) == ready, "i.ready follows i.valid within the cycle"
            ctx.set(fifo.i.valid, want)
            if want and ready:
                state["sent"] += 1
            await ctx.tick("write")

    async def consumer(ctx):
        o = fifo.o
        rounds = 3
        for _ in range(rounds):
            base = state["got"]
            # fill: exactly depth + 1 words, then nothing more for a long while
            state["limit"], state["phase"] = base + 10 * depth, "fill"
            ctx.set(o.ready, 0)
            for _ in range(60):
                await ctx.tick("read")
            assert state["sent"] - base == depth + 1, f"{state['sent'] - base} words held, expected {depth + 1}"
            assert ctx.get(o.valid) and ctx.get(o.payload) == word(base)
            before = (ctx.get(o.valid), ctx.get(o.payload))
            ctx.set(o.ready, 1)
            assert (ctx.get(o.valid), ctx.get(o.payload)) == before, "o follows o.ready within the cycle"
            # one word out: exactly one more in
            await ctx.tick("read")
            ctx.set(o.ready, 0)
            state["got"] += 1
            for _ in range(40):
                await ctx.tick("read")
            assert state["sent"] - state["got"] == depth + 1, "a word out did not free exactly one slot"
            # drain: in order, then empty for good
            state["phase"] = "drain"
            ctx.set(o.ready, 1)
            while state["got"] < state["sent"]:
                assert ctx.get(o.valid), f"o.valid fell with {state['sent'] - state['got']} words inside"
                assert ctx.get(o.payload) == word(state["got"])
                await ctx.tick("read")
                state["got"] += 1
            for _ in range(40):
                assert not ctx.get(o.valid), "o.valid after the FIFO was drained"
                await ctx.tick("read")
            # a lone word comes through the empty FIFO
            state["limit"], state["phase"] = state["sent"] + 1, "lone"
            for _ in range(60):
                if ctx.get(o.valid):
                    break
                await ctx.tick("read")
            assert ctx.get(o.valid) and ctx.get(o.payload) == word(state["got"])
            await ctx.tick("read")
            state["got"] += 1
            assert not ctx.get(o.valid)
        state["done"] = True

    simulate(h, w_period, r_period, r_phase, producer, consumer)
    assert state["got"] == state["sent"] == 3 * (depth + 3)


@pytest.mark.parametrize("w_period,r_period,r_phase", CLOCKS, ids=CLOCK_IDS)
def test_latency(w_period, r_period, r_phase):
    """A word taken into an empty FIFO at a write clock edge is on ``o`` after the fourth read
    clock edge that follows (two synchronizer stages, the empty flag, the output register), and
    a slot the read side frees is the writer's again at the third write edge after."""
    h = Harness(8)
    fifo = h.fifo
    seen = []

    async def bench(ctx):
        await ctx.tick("write").repeat(8)
        for k in range(12):
            ctx.set(fifo.i.valid, 1)
            ctx.set(fifo.i.payload, word(k))
            assert ctx.get(fifo.i.ready)
            await ctx.tick("write")
            ctx.set(fifo.i.valid, 0)
            edges = 0
            while not ctx.get(fifo.o.valid):
                await ctx.tick("read")
                edges += 1
            seen.append(edges)
            assert ctx.get(fifo.o.payload) == word(k)
            ctx.set(fifo.o.ready, 1)
            await ctx.tick("read")
            ctx.set(fifo.o.ready, 0)
            for _ in range(7):  # the write and read edges at k's own phase
                await ctx.tick("write")

    simulate(h, w_period, r_period, r_phase, bench)
    assert seen == [4] * 12, seen


#: Words each way in the throughput runs; the first and last STEADY_SKIP are the ramp.
THROUGHPUT_WORDS, STEADY_SKIP = 1500, 200


def steady_rate(h, w_period, r_period, r_phase):
    """(words a cycle of the slower clock, write cycles a word, read cycles a word) between
    word ``STEADY_SKIP`` and ``THROUGHPUT_WORDS - STEADY_SKIP``, both sides always willing."""
    sb = Scoreboard(h, THROUGHPUT_WORDS)
    simulate(h, w_period, r_period, r_phase, sb.producer, sb.consumer)
    a, b = STEADY_SKIP, THROUGHPUT_WORDS - STEADY_SKIP
    per_write = (sb.sent_at[b] - sb.sent_at[a]) / (b - a)
    per_read = (sb.got_at[b] - sb.got_at[a]) / (b - a)
    slower = per_write if w_period >= r_period else per_read
    return 1 / slower, per_write, per_read


@pytest.mark.parametrize("depth", [8, 16])
@pytest.mark.parametrize("w_period,r_period,r_phase", CLOCKS, ids=CLOCK_IDS)
def test_throughput_a_word_a_cycle_of_the_slower_clock(w_period, r_period, r_phase, depth):
    """Both sides always willing: in steady state, a word every cycle of the slower clock
    (measured: the write cycles a word and the read cycles a word over the middle 1,100 of
    1,500 words; the faster side's follow the ratio of the periods), at every pair of clocks,
    from ``depth=8`` up (``CROSSING_DEPTH``)."""
    rate, per_write, per_read = steady_rate(Harness(depth), w_period, r_period, r_phase)
    print(f"depth {depth}, {w_period} ns -> {r_period} ns: "
          f"{per_write:.3f} write cycles, {per_read:.3f} read cycles a word")
    assert rate == 1.0, (per_write, per_read)
    assert per_write == pytest.approx(max(1, r_period / w_period), rel=0.01)
    assert per_read == pytest.approx(max(1, w_period / r_period), rel=0.01)


@pytest.mark.parametrize("w_period,r_period,r_phase,rate", [(8.0, 8.0, None, 4 / 8), (8.0, 8.0, 3.0, 4 / 7)],
                         ids=["8-8", "8-8+3"])
def test_throughput_is_bounded_by_the_round_trip(w_period, r_period, r_phase, rate):
    """What the throughput test measures: with fewer slots than the pointers' round trip (a
    word's slot is free again 7 or 8 cycles after it was taken, at equal clocks: 4 edges to
    ``o``, 3 back), ``depth`` words a round trip: 4 in 8 or 7 cycles with ``depth=4``."""
    got, _, _ = steady_rate(Harness(4), w_period, r_period, r_phase)
    assert got == pytest.approx(rate, rel=0.01)


#: The reset runs' clocks: ``CLOCKS``' unrelated pairs and out-of-phase pair, and a writer far
#: faster than its reader (which, with a stale read pointer after its reset, could lap it).
RESET_CLOCKS = CLOCKS[:2] + CLOCKS[3:4] + [(2.0, 37.0, None)]


@pytest.mark.parametrize("w_period,r_period,r_phase", RESET_CLOCKS, ids=CLOCK_IDS[:2] + CLOCK_IDS[3:4] + ["2-37"])
@pytest.mark.parametrize("reset_cycles", [1, 5])
def test_write_reset_empties_the_fifo(w_period, r_period, r_phase, reset_cycles):
    """The write domain's reset, while the FIFO is full and its consumer stalled: the words
    inside are dropped, ``o`` empties, and the words offered from the cycle after the reset
    (at once: the FIFO takes them once its read side has followed the reset) come out whole
    and in order. What the consumer took before the reset is a prefix of what was sent."""
    h = Harness(8)
    fifo = h.fifo
    pre, post = 30, 400
    reset_at = int(60 * r_period / w_period) + 100  # a write cycle, after the read side's 60th
    w_cycles = reset_at + int(4000 * max(1.0, r_period / w_period))
    log = {"pre_sent": None, "got": []}

    def pre_word(k):
        return word(k)

    def post_word(k):
        return word(k + 5000)

    async def producer(ctx):
        k = 0
        for cycle in range(w_cycles):
            if cycle == reset_at:  # the consumer has stalled for a while: the FIFO is full
                ctx.set(fifo.i.valid, 0)
                log["pre_sent"] = k
                # just after a read edge: the read side's rewind waits the longest, a stale
                # read pointer the writer sees lasts the longest
                await ctx.posedge(h.read.clk)
                ctx.set(h.write.rst, 1)
                for _ in range(reset_cycles):
                    await ctx.posedge(h.write.clk)  # (a tick would stop at the reset)
                ctx.set(h.write.rst, 0)
                k = 0
            phase_post = log["pre_sent"] is not None
            if phase_post and k == post:
                ctx.set(fifo.i.valid, 0)
                return
            if not phase_post and k == pre:
                ctx.set(fifo.i.valid, 0)
                await ctx.tick("write")
                continue
            ctx.set(fifo.i.valid, 1)
            ctx.set(fifo.i.payload, post_word(k) if phase_post else pre_word(k))
            if ctx.get(fifo.i.ready):
                k += 1
            await ctx.tick("write")
        raise AssertionError("the FIFO stopped taking words")

    async def consumer(ctx):
        rng = random.Random(reset_cycles)
        for cycle in range(int(w_cycles * w_period / r_period) + 1000):
            # 4 words taken (the read pointer at 5, the 5th on o: a stale copy of it leaves the
            # writer 13 slots after its reset, not 8), then stalled until 50 ns after the reset
            before = len(log["got"]) < 4 and cycle < 60
            ready = (before or cycle * r_period > reset_at * w_period + 50) and rng.random() < 0.7
            ctx.set(fifo.o.ready, ready)
            if ctx.get(fifo.o.valid) and ready:
                log["got"].append(ctx.get(fifo.o.payload))
            await ctx.tick("read")

    simulate(h, w_period, r_period, r_phase, producer, consumer)
    got = log["got"]
    before = [w for w in got if w in {pre_word(k) for k in range(pre)}]
    assert got[:len(before)] == [pre_word(k) for k in range(len(before))], "the words before the reset out of order"
    assert len(before) == 4
    assert got[len(before):] == [post_word(k) for k in range(post)], "the words after the reset not all, in order"


@pytest.mark.parametrize("w_period,r_period,r_phase", CLOCKS[:2], ids=CLOCK_IDS[:2])
def test_read_reset_keeps_the_words(w_period, r_period, r_phase):
    """The read domain's own reset, mid-stream, with words inside and one on ``o``: nothing is
    lost or repeated (the read side's registers are reset-less, as AsyncFIFO's counters)."""
    h = Harness(8)
    sb = Scoreboard(h, 1500, valid_p=0.8, ready_p=0.6, seed=7)
    sb.read_pause = lambda cycle: 100 <= cycle < 140  # the consumer holds through the reset

    async def reset(ctx):
        await ctx.tick("read").repeat(110)
        assert ctx.get(h.fifo.o.valid)
        ctx.set(h.read.rst, 1)
        for _ in range(5):
            await ctx.posedge(h.read.clk)
        ctx.set(h.read.rst, 0)

    simulate(h, w_period, r_period, r_phase, sb.producer, sb.consumer, reset)
    assert sb.got == sb.sent == sb.n


def test_depth_is_checked():
    for depth in (0, 1, 3, 12, 8.0, True):
        with pytest.raises(ValueError, match="depth must be a power of 2, at least 2"):
            AsyncStreamFifo(8, depth=depth)
