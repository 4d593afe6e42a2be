"""Data-parallel training on torch.distributed: one device per rank, gradients exchanged as BFP.

Each rank opens its own device (``rank_spec`` puts the rank into a device spec, e.g.
``tcp:127.0.0.1:{7000+rank}``), trains a replica of the model on its share of every batch, and
DDP keeps the replicas equal by exchanging gradients after every backward pass. ``attach``
registers the exchange as a DDP communication hook (``GradExchange``):

- ``none``: fp32 gradients summed by ``all_reduce`` (DDP's own arithmetic), then divided by the
  number of ranks.
- ``hbfp8`` / ``mxint8``: each rank quantizes its gradient bucket (a flat fp32 vector viewed as
  a matrix one tile wide, so that every tile shares its exponent among consecutive values: 576
  for HBFP8's 24 x 24 tiles, 32 for MXINT8's 1 x 32) to the format, rounding to nearest even.
  The default exchange (``two_step``) splits the tiles into one shard per rank: an all-to-all
  gives rank j every rank's codes and exponents of shard j, which it dequantizes and adds in
  rank order, 0 first, in fp32, and quantizes with stochastic rounding (seeded by the exchange's
  number and the shard, ``shard_seed``); a second all-to-all gives every rank every shard's
  quantized sum, which it dequantizes and divides by the number of ranks. ``gather`` is the one
  step: the ranks ``all_gather`` their whole buckets' codes and exponents, and every rank adds
  them all in rank order. Either way every rank forms the result from the same bytes in the
  same order, so it is bit-identical on every rank. ``error_feedback`` keeps what a rank's
  quantization dropped from a bucket and adds it to that bucket's next gradient.

Bytes: ``GradExchange.bytes_sent`` counts what each rank sends, ``bytes_fp32_ring`` what a fp32
ring all-reduce of the same buckets sends: ``2 (N - 1) / N * P`` for a ``P``-byte bucket. The
two-step exchange sends ``2 (N - 1) / N`` of its codes and exponents (about ``P / 4``): about 4x
fewer at every N. The gather sends ``(N - 1)`` times its contribution, so its advantage is about
``8 / N`` (4x at 2 ranks, 2x at 4, none at 8).

Ending a rank: DDP keeps its process group, and gloo's threads, alive past
``destroy_process_group`` (torch 2.13), and tearing them down while the interpreter exits now
and then aborts a process whose work succeeded (SIGABRT, "terminate called without an active
exception"). ``exit_rank`` ends a rank's process once its group is down and its output
written, without that teardown.
"""

import os
import re
import socket
import sys

import torch
import torch.distributed as dist

__all__ = ["COMPRESSIONS", "EXCHANGES", "GradExchange", "shard_seed", "attach", "rank_spec", "params_equal", "free_port", "exit_rank"]

#: Gradient exchanges: fp32, or BFP codes and shared exponents in one of these formats.
COMPRESSIONS = ("none", "hbfp8", "mxint8")


def _format(compression: str):
    from hbfp.golden import HBFP8, MXINT8

    return {"hbfp8": HBFP8, "mxint8": MXINT8}[compression]


_RANK_EXPR = re.compile(r"\{\s*(?:(\d+)\s*\+\s*)?rank\s*(?:\+\s*(\d+)\s*)?\}")


def rank_spec(spec: str, rank: int) -> str:
    """``spec`` with ``{rank}``, ``{N+rank}`` or ``{rank+N}`` replaced by the number, e.g.
    ``tcp:127.0.0.1:{7000+rank}`` -> ``tcp:127.0.0.1:7001`` on rank 1; other braces are an error."""
    out = _RANK_EXPR.sub(lambda m: str(int(m.group(1) or 0) + rank + int(m.group(2) or 0)), spec)
    if "{" in out or "}" in out:
        raise ValueError(f"device spec {spec!r}: only {{rank}}, {{N+rank}} and {{rank+N}} may stand in braces")
    return out


#: How BFP gradients are exchanged: ``two_step`` (all-to-all of shards, a sum per shard, an
#: all-gather of the quantized sums) or ``gather`` (an all-gather of every rank's codes).
EXCHANGES = ("two_step", "gather")


class GradExchange:
    """The state of the DDP communication hook: the compression, the exchange, the process
    group, error feedback, the bytes this rank has sent (and what a fp32 ring all-reduce of the
    same buckets would have sent) and the exchanges it has made.

    A compressed exchange runs in stages (``_Bucket``): quantize and send, then (the first
    collective done) sum this rank's shard and send it, then (the second done) write the mean.
    The collectives are gloo's asynchronous ones: they move the bytes, and wait for the other
    ranks, on gloo's threads. ``overlap``: the hook starts its bucket and moves each bucket
    still under way one stage on, then returns, so backward goes on while the collectives run;
    the hook of the last bucket of a backward pass finishes them all, a stage of each bucket at
    a time. Which collective starts when follows the order of the hook's calls alone (the same
    on every rank), never timing, so the ranks' collectives always match. ``overlap`` False:
    each hook finishes its bucket before backward goes on. Both give the same bits.
    """

    def __init__(self, compression: str = "none", group=None, *, exchange: str = "two_step",
                 error_feedback: bool = False, overlap: bool = True):
        if compression not in COMPRESSIONS:
            raise ValueError(f"grad compression must be one of {COMPRESSIONS}, got {compression!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"grad exchange must be one of {EXCHANGES}, got {exchange!r}")
        if error_feedback and compression == "none":
            raise ValueError("error feedback needs a compressed exchange (--grad-compression hbfp8 or mxint8)")
        self.compression, self.kind = compression, exchange
        self.error_feedback, self.overlap = error_feedback, overlap
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.bytes_fp32_ring = 0
        self.exchanges = 0
        self._residuals: dict = {}  # error feedback: each bucket's matrix, holding what it dropped
        self._scratch = _Scratch()  # buffers by role (a bucket's own while its collectives run)
        self._under_way: list[_Bucket] = []

    def exchange(self, flat: torch.Tensor, key=0) -> torch.Tensor:
        """The mean over the ranks of ``flat`` (a 1-D fp32 gradient bucket), in place. ``key``
        names the bucket whose rounding error feeds back into its next exchange."""
        self._count(flat)
        if self.compression == "none":
            dist.all_reduce(flat, group=self.group)
            return flat.div_(self.world)
        self._start(flat, key)
        self._finish()
        return flat

    def _start(self, flat: torch.Tensor, key) -> "_Bucket":
        """Quantize ``flat`` and send it: stage 1 of its exchange, under way after it."""
        fmt = _format(self.compression)
        mat = self._tiles(flat, key, fmt)
        codes, exps = _quantize(mat, fmt)
        if self.error_feedback:  # what this rank's rounding dropped, added to its next gradient
            mat.sub_(_dequantize(codes, exps, fmt, out=self._scratch.get("dropped", mat.shape, torch.float32, mat.device)))
        b = _Bucket(flat, key, self.exchanges, fmt, codes.shape[1], exps.shape[1:])
        if self.kind == "gather":
            self._send_all(b, codes, exps)
        else:
            self._send_shards(b, codes, exps)
        self._under_way.append(b)
        return b

    def _step(self, b: "_Bucket") -> None:
        """Move bucket ``b`` one stage on (waiting for its collective)."""
        if self.kind == "gather":
            self._add_all(b)
        elif b.stage == 1:
            self._sum_shard(b)
        else:
            self._write_mean(b)

    def _finish(self) -> None:
        """Every bucket under way to its end, a stage of each at a time, in the order they began."""
        while self._under_way:
            for b in list(self._under_way):
                self._step(b)
            self._under_way = [b for b in self._under_way if not b.future.done()]

    def _tiles(self, flat: torch.Tensor, key, fmt) -> torch.Tensor:
        """``flat`` in fp32, zero-padded to whole rows, as a matrix one tile wide: every tile a
        run of consecutive gradient values (576 for HBFP8's 24 x 24 tiles, 32 for MXINT8's
        1 x 32). With error feedback it is bucket ``key``'s own matrix, which holds what the
        last exchange of that bucket dropped, and ``flat`` is added to it; else scratch."""
        width = fmt.tile[1]
        n = flat.numel()
        shape = (-(-n // width), width)
        if self.error_feedback:
            mat = self._residuals.get(key)
            if mat is not None and mat.shape == shape and mat.device == flat.device:
                mat.view(-1)[:n].add_(flat.detach())  # the residual's padding stays zero
                return mat
            mat = self._residuals[key] = torch.empty(shape, dtype=torch.float32, device=flat.device)
        else:
            mat = self._scratch.get("tiles", shape, torch.float32, flat.device)
        mat.view(-1)[:n].copy_(flat.detach())
        mat.view(-1)[n:].zero_()
        return mat

    # ---- gather: every rank's codes to every rank -------------------------------------------

    def _send_all(self, b, codes, exps) -> None:
        world = self.world
        b.codes = [torch.empty_like(codes) for _ in range(world)]
        b.exps = [torch.empty_like(exps) for _ in range(world)]
        b.works = [dist.all_gather(b.codes, codes, group=self.group, async_op=True),
                   dist.all_gather(b.exps, exps, group=self.group, async_op=True)]
        self.bytes_sent += (world - 1) * (codes.numel() * codes.element_size() + exps.numel())

    def _add_all(self, b) -> None:
        """Every rank's contribution dequantized and added in rank order; the mean written."""
        for w in b.works:
            w.wait()
        total = None
        for c, e in zip(b.codes, b.exps):
            d = _dequantize(c, e, b.fmt)
            total = d if total is None else total.add_(d)  # rank order, fp32
        self._done(b, total)

    # ---- two steps: shard j of every rank's codes to rank j, its sum back to every rank -------

    def _send_shards(self, b, codes, exps) -> None:
        """Stage 1: the tiles split into one shard per rank (the last tile may be partial);
        shard j of this rank's codes and exponents to rank j (an all-to-all)."""
        world, tile_rows, width = self.world, b.fmt.tile[0], b.width
        b.shards = _shards(exps.shape[0], world)  # tiles per shard
        ends = [min(sum(b.shards[:j + 1]) * tile_rows, codes.shape[0]) for j in range(world)]
        b.rows = [e - s for s, e in zip([0] + ends[:-1], ends)]
        b.sizes = [r * width + t for r, t in zip(b.rows, b.shards)]  # codes' bytes, then exponents
        b.mine = b.sizes[self.rank]
        send = self._scratch.get(("send", b.key), (sum(b.sizes),), torch.uint8, codes.device)
        for c, e, into in zip(codes.split(b.rows), exps.split(b.shards), send.split(b.sizes)):
            _pack(into, c, e)
        b.recv = self._scratch.get(("recv", b.key), (b.mine * world,), torch.uint8, codes.device)
        b.works = [dist.all_to_all_single(b.recv, send, [b.mine] * world, b.sizes, group=self.group, async_op=True)]
        self.bytes_sent += sum(b.sizes) - b.mine
        b.stage = 1

    def _sum_shard(self, b) -> None:
        """Stage 2: every rank's codes of this rank's shard dequantized and added in rank order,
        the sum quantized (stochastic rounding, seeded by the exchange and the shard) and sent
        to every rank (the all-to-all again, this rank's one shard to all)."""
        b.works[0].wait()
        world, rank, dev = self.world, self.rank, b.recv.device
        r, t = b.rows[rank], b.shards[rank]
        own = self._scratch.get(("own", b.key), (b.mine * world,), torch.uint8, dev)
        if r:  # a shard of tiles (none when there are fewer tiles than ranks)
            total = self._scratch.get("sum", (r, b.width), torch.float32, dev)
            part = self._scratch.get("part", (r, b.width), torch.float32, dev)
            for i, packed in enumerate(b.recv.split(b.mine)):  # rank order
                c, e = _unpack(packed, r, t, b.width, b.exp_shape)
                if i == 0:
                    _dequantize(c, e, b.fmt, out=total)
                else:
                    total.add_(_dequantize(c, e, b.fmt, out=part))
            sc, se = _quantize(total, b.fmt.with_rounding("stochastic"), seed=shard_seed(b.number, rank))
            for into in own.split(b.mine):
                _pack(into, sc, se)
        b.gathered = self._scratch.get(("gathered", b.key), (sum(b.sizes),), torch.uint8, dev)
        b.works = [dist.all_to_all_single(b.gathered, own, b.sizes, [b.mine] * world, group=self.group,
                                          async_op=True)]
        self.bytes_sent += (world - 1) * b.mine
        b.stage = 2

    def _write_mean(self, b) -> None:
        """Stage 3: every shard's quantized sum dequantized; the mean written."""
        b.works[0].wait()
        result = self._scratch.get("result", (sum(b.rows), b.width), torch.float32, b.gathered.device)
        for packed, r, t, res in zip(b.gathered.split(b.sizes), b.rows, b.shards, result.split(b.rows)):
            if r:
                _dequantize(*_unpack(packed, r, t, b.width, b.exp_shape), b.fmt, out=res)
        self._done(b, result)

    def _done(self, b, total) -> None:
        b.flat.copy_(total.view(-1)[:b.flat.numel()].div_(self.world))
        b.future.set_result(b.flat)

    def _count(self, flat: torch.Tensor) -> None:
        """An exchange of ``flat`` begins: counted, with what a fp32 ring all-reduce of it
        sends (and, uncompressed, what this one sends: the same ring)."""
        self.exchanges += 1
        self.bytes_fp32_ring += _ring_bytes(4 * flat.numel(), self.world)
        if self.compression == "none":
            self.bytes_sent += _ring_bytes(flat.numel() * flat.element_size(), self.world)

    # ---- the hook ----------------------------------------------------------------------------

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """DDP's communication hook: the bucket's mean, in a future."""
        flat, key = bucket.buffer(), bucket.index()
        self._count(flat)
        if self.compression == "none":
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            if not self.overlap:
                work.wait()
            world = self.world
            return work.get_future().then(lambda f: f.value()[0].div_(world))
        try:
            older = list(self._under_way)
            b = self._start(flat, key)
            if self.overlap and not bucket.is_last():
                for o in older:  # one stage on each: their collectives run while backward goes on
                    self._step(o)
                self._under_way = [o for o in self._under_way if not o.future.done()]
            else:
                self._finish()
        except BaseException as e:  # backward raises it; nothing is left under way
            for o in self._under_way:
                if not o.future.done():
                    o.future.set_exception(e)
            self._under_way = []
            raise
        return b.future


class _Bucket:
    """One bucket's exchange under way: its stage, collectives and buffers."""

    def __init__(self, flat, key, number, fmt, width, exp_shape):
        self.flat, self.key, self.number, self.fmt = flat, key, number, fmt
        self.width, self.exp_shape = width, exp_shape
        self.stage = 0
        self.future = torch.futures.Future()


def shard_seed(exchange: int, shard: int) -> int:
    """The seed of the stochastic rounding of ``shard``'s sum in exchange number ``exchange``
    (counted from 1 by each ``GradExchange``, the same on every rank): each exchange and
    shard a stream of its own."""
    return ((exchange << 8) + shard) & 0xFFFF_FFFF


def _ring_bytes(payload: int, world: int) -> int:
    """What each rank sends in a ring all-reduce of ``payload`` bytes."""
    return 2 * (world - 1) * payload // world


def _shards(tiles: int, world: int) -> list[int]:
    """``tiles`` split among ``world`` shards as evenly as whole tiles allow (the first ones
    one tile more)."""
    q, r = divmod(tiles, world)
    return [q + (j < r) for j in range(world)]


def _unpack(part: torch.Tensor, rows: int, tiles: int, width: int, exp_shape) -> tuple:
    """A packed shard's codes (``rows`` x ``width``, int8) and exponents (``tiles`` of them)."""
    return part[:rows * width].view(torch.int8).view(rows, width), part[rows * width:].view(tiles, *exp_shape)


class _Scratch:
    """Buffers an exchange writes into, kept between exchanges by their role: a bucket's fp32
    buffers are tens of MB, and allocating them anew costs the page faults of their every page
    (about 15 ms of a 150 ms 2-rank step of 15 M parameters)."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, role, shape, dtype, device) -> torch.Tensor:
        """A contiguous ``shape`` of ``dtype`` on ``device``, its contents left from before."""
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(role)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self._bufs[role] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


def _pack(into: torch.Tensor, codes: torch.Tensor, exps: torch.Tensor) -> None:
    """A shard's codes' bytes, then its exponents, into the bytes ``into``."""
    nc = codes.numel()
    into[:nc].copy_(codes.reshape(-1).view(torch.uint8))
    into[nc:].copy_(exps.reshape(-1))


def _quantize(mat, fmt, seed=None):
    from hbfp import kernels

    codes, exps = kernels.quantize(mat, fmt, seed=seed)
    return codes.contiguous(), exps.contiguous()


def _dequantize(codes, exps, fmt, out=None):
    from hbfp import kernels

    return kernels.dequantize(codes, exps, fmt, out=out)


def _hook(state: GradExchange, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.hook(bucket)


def attach(model: "torch.nn.parallel.DistributedDataParallel", compression: str = "none", group=None, *,
           exchange: str = "two_step", error_feedback: bool = False, overlap: bool = True) -> GradExchange:
    """Register the gradient exchange on a DDP model; returns its state (``bytes_sent``)."""
    state = GradExchange(compression, group, exchange=exchange, error_feedback=error_feedback, overlap=overlap)
    model.register_comm_hook(state, _hook)
    return state


def params_equal(model: torch.nn.Module, group=None) -> bool:
    """Whether every rank holds the same parameters, bit for bit (a collective: every rank calls it)."""
    flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g.view(torch.int32), gathered[0].view(torch.int32)) for g in gathered)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous of ranks this process launches."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> bool:
    """Whether this process was started as a rank (by torchrun or ``hbfp train --nproc``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def exit_rank(status: int = 0) -> None:
    """End this rank's process with ``status``: its process group destroyed (if still up), its
    output flushed, and no exit-time teardown of the threads DDP leaves behind (see the module's
    text). Call it last, after every file the rank writes is closed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
