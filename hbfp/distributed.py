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

    ``overlap``: exchanges run on a worker thread, one bucket after another in the order DDP
    hands them over (the same on every rank), while the backward pass goes on; False: in the
    hook, before backward continues. The last bucket of a backward pass is exchanged in the hook
    either way (after those queued before it): nothing is left to overlap it with, and a model
    of one bucket then never waits for a thread.
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
        self._scratch = _Scratch()  # one exchange at a time uses it (the worker's, then the hook's)
        self._worker = None

    def exchange(self, flat: torch.Tensor, key=0) -> torch.Tensor:
        """The mean over the ranks of ``flat`` (a 1-D fp32 gradient bucket), in place. ``key``
        names the bucket whose rounding error feeds back into its next exchange."""
        n, world = flat.numel(), self.world
        self._count(flat)
        if self.compression == "none":
            dist.all_reduce(flat, group=self.group)
            return flat.div_(world)
        fmt = _format(self.compression)
        mat = self._tiles(flat, key, fmt)
        codes, exps = _quantize(mat, fmt)
        if self.error_feedback:  # what this rank's rounding dropped, added to its next gradient
            mat.sub_(_dequantize(codes, exps, fmt, out=self._scratch.get("dropped", mat.shape, torch.float32, mat.device)))
        if self.kind == "gather":
            total = self._gather(codes, exps, fmt)
        else:
            total = self._two_step(codes, exps, fmt)
        flat.copy_(total.view(-1)[:n].div_(world))
        return flat

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

    def _gather(self, codes, exps, fmt):
        """Every rank's codes to every rank, dequantized and added in rank order."""
        world = self.world
        all_codes = [torch.empty_like(codes) for _ in range(world)]
        all_exps = [torch.empty_like(exps) for _ in range(world)]
        dist.all_gather(all_codes, codes, group=self.group)
        dist.all_gather(all_exps, exps, group=self.group)
        self.bytes_sent += (world - 1) * (codes.numel() * codes.element_size() + exps.numel())
        total = _dequantize(all_codes[0], all_exps[0], fmt)
        for c, e in zip(all_codes[1:], all_exps[1:]):
            total = total + _dequantize(c, e, fmt)  # rank order, fp32
        return total

    def _two_step(self, codes, exps, fmt):
        """Shard j of every rank's codes to rank j (all-to-all), which adds them in rank order
        and quantizes the sum (stochastic rounding, seeded by the exchange and the shard); then
        every shard's sum to every rank (the all-to-all again, each rank's one shard to all)."""
        world, rank = self.world, self.rank
        tile_rows = fmt.tile[0]
        shards = _shards(exps.shape[0], world)  # tiles per shard
        ends = [min(sum(shards[:j + 1]) * tile_rows, codes.shape[0]) for j in range(world)]
        rows = [e - b for b, e in zip([0] + ends[:-1], ends)]  # the last tile may be partial
        width = codes.shape[1]
        # each shard packed as its codes' bytes, then its exponents
        sizes = [r * width + t for r, t in zip(rows, shards)]
        scratch, dev = self._scratch, codes.device
        send = scratch.get("send", (sum(sizes),), torch.uint8, dev)
        for c, e, b in zip(codes.split(rows), exps.split(shards), send.split(sizes)):
            _pack(b, c, e)
        mine = sizes[rank]
        recv = scratch.get("recv", (mine * world,), torch.uint8, dev)
        dist.all_to_all_single(recv, send, [mine] * world, sizes, group=self.group)
        self.bytes_sent += sum(sizes) - mine
        r, t = rows[rank], shards[rank]
        own = scratch.get("own", (mine * world,), torch.uint8, dev)  # this rank's quantized sum, once per rank
        if r:  # a shard of tiles (none when there are fewer tiles than ranks)
            total = scratch.get("sum", (r, width), torch.float32, dev)
            part = scratch.get("part", (r, width), torch.float32, dev)
            for i, packed in enumerate(recv.split(mine)):  # rank order
                c, e = _unpack(packed, r, t, width, exps.shape[1:])
                if i == 0:
                    _dequantize(c, e, fmt, out=total)
                else:
                    total.add_(_dequantize(c, e, fmt, out=part))
            sc, se = _quantize(total, fmt.with_rounding("stochastic"), seed=self.seed(rank))
            for b in own.split(mine):
                _pack(b, sc, se)
        gathered = scratch.get("gathered", (sum(sizes),), torch.uint8, dev)
        dist.all_to_all_single(gathered, own, sizes, [mine] * world, group=self.group)
        self.bytes_sent += (world - 1) * mine
        result = scratch.get("result", codes.shape, torch.float32, dev)
        for packed, r, t, res in zip(gathered.split(sizes), rows, shards, result.split(rows)):
            if r:
                _dequantize(*_unpack(packed, r, t, width, exps.shape[1:]), fmt, out=res)
        return result

    def seed(self, shard: int) -> int:
        """The seed of the stochastic rounding of ``shard``'s sum in the current exchange."""
        return shard_seed(self.exchanges, shard)

    def _count(self, flat: torch.Tensor) -> None:
        """An exchange of ``flat`` begins: counted, with what a fp32 ring all-reduce of it
        sends (and, uncompressed, what this one sends: the same ring)."""
        self.exchanges += 1
        self.bytes_fp32_ring += _ring_bytes(4 * flat.numel(), self.world)
        if self.compression == "none":
            self.bytes_sent += _ring_bytes(flat.numel() * flat.element_size(), self.world)

    # ---- the hook ----------------------------------------------------------------------------

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """DDP's communication hook: the bucket's mean, in a future (set by the worker thread
        when ``overlap``)."""
        flat, key = bucket.buffer(), bucket.index()
        if not self.overlap:
            fut = torch.futures.Future()
            fut.set_result(self.exchange(flat, key))
            return fut
        if self.compression == "none":  # gloo runs it in the background already
            self._count(flat)
            world = self.world
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            return work.get_future().then(lambda f: f.value()[0].div_(world))
        if bucket.is_last():  # nothing of backward left to overlap: after those queued, here
            if self._worker is not None:
                self._worker.drain()
            fut = torch.futures.Future()
            fut.set_result(self.exchange(flat, key))
            return fut
        return self._start_worker().submit(self.exchange, flat, key)

    def _start_worker(self):
        if self._worker is None:
            self._worker = _Worker()
        return self._worker


class _Worker:
    """One thread that runs exchanges in the order they are submitted: collectives then follow
    each other in the same order on every rank."""

    def __init__(self):
        import queue
        import threading

        self._jobs = queue.SimpleQueue()
        self._last = None
        threading.Thread(target=self._run, name="hbfp-grad-exchange", daemon=True).start()

    def submit(self, fn, *args) -> torch.futures.Future:
        fut = torch.futures.Future()
        self._last = fut
        self._jobs.put((fut, fn, args))
        return fut

    def drain(self) -> None:
        """Wait until every job submitted so far has run (its error, if any, is its future's)."""
        last = self._last
        if last is not None and not last.done():
            try:
                last.wait()
            except Exception:  # noqa: BLE001 - its error reaches backward through its own future
                pass

    def _run(self):
        while True:
            fut, fn, args = self._jobs.get()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the waiting backward pass raises it
                fut.set_exception(e)


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

    def get(self, role: str, shape, dtype, device) -> torch.Tensor:
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
