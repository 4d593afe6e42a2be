"""Data-parallel training on torch.distributed: one device per rank, gradients exchanged as BFP.

Each rank opens its own device (``rank_spec`` puts the rank into a device spec, e.g.
``tcp:127.0.0.1:{7000+rank}``), trains a replica of the model on its share of every batch, and
DDP keeps the replicas equal by exchanging gradients after every backward pass. ``attach``
registers the exchange as a DDP communication hook (``GradExchange``):

- ``none``: fp32 gradients summed by ``all_reduce`` (DDP's own arithmetic), then divided by the
  number of ranks.
- ``hbfp8`` / ``mxint8``: each rank quantizes its gradient bucket (a flat fp32 vector viewed as
  a matrix one tile wide, so that every tile shares its exponent among consecutive values: 576
  for HBFP8's 24 x 24 tiles, 32 for MXINT8's 1 x 32) to the format, rounding to nearest even; the ranks ``all_gather`` the codes (1 byte each) and the
  shared exponents (1 byte per tile); every rank dequantizes all contributions and adds them in
  rank order, 0 first, in fp32, then divides by the number of ranks. Every rank forms the same
  sum from the same bytes in the same order, so the result is bit-identical on every rank. No
  error feedback is kept: what rounding drops from a gradient is lost, as in an HBFP8 product.

Bytes: ``GradExchange.bytes_sent`` counts what each rank sends: a ring all-reduce of ``P``
bytes sends ``2 (N - 1) / N * P``; an all-gather of a ``P``-byte contribution sends
``(N - 1) * P``. With 2 ranks the BFP exchange sends a quarter of the fp32 one (plus one byte
per tile); the gather's cost grows with N where the ring's does not, so its advantage is about
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

__all__ = ["COMPRESSIONS", "GradExchange", "attach", "rank_spec", "params_equal", "free_port", "exit_rank"]

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


class GradExchange:
    """The state of the DDP communication hook: the compression, the process group, the bytes
    this rank has sent and the exchanges it has made."""

    def __init__(self, compression: str = "none", group=None):
        if compression not in COMPRESSIONS:
            raise ValueError(f"grad compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.compression = compression
        self.group = group
        self.world = dist.get_world_size(group)
        self.bytes_sent = 0
        self.exchanges = 0

    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of ``flat`` (a 1-D fp32 gradient bucket), in place."""
        n, world = flat.numel(), self.world
        self.exchanges += 1
        if self.compression == "none":
            self.bytes_sent += 2 * (world - 1) * n * flat.element_size() // world
            dist.all_reduce(flat, group=self.group)
            return flat.div_(world)
        from hbfp import kernels

        # a matrix one tile wide: every tile a run of consecutive gradient values (576 for
        # HBFP8's 24 x 24 tiles, 32 for MXINT8's 1 x 32)
        fmt = _format(self.compression)
        width = fmt.tile[1]
        rows = -(-n // width)
        mat = torch.zeros(rows * width, dtype=torch.float32)
        mat[:n] = flat.detach().to(torch.float32)
        codes, exps = kernels.quantize(mat.view(rows, width), fmt)
        codes, exps = codes.contiguous(), exps.contiguous()
        all_codes = [torch.empty_like(codes) for _ in range(world)]
        all_exps = [torch.empty_like(exps) for _ in range(world)]
        dist.all_gather(all_codes, codes, group=self.group)
        dist.all_gather(all_exps, exps, group=self.group)
        self.bytes_sent += (world - 1) * (codes.numel() * codes.element_size() + exps.numel())
        total = kernels.dequantize(all_codes[0], all_exps[0], fmt)
        for c, e in zip(all_codes[1:], all_exps[1:]):
            total = total + kernels.dequantize(c, e, fmt)  # rank order, fp32
        flat.copy_(total.view(-1)[:n].div_(world).to(flat.dtype))
        return flat


def _hook(state: GradExchange, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(state.exchange(bucket.buffer()))
    return fut


def attach(model: "torch.nn.parallel.DistributedDataParallel", compression: str = "none", group=None) -> GradExchange:
    """Register the gradient exchange on a DDP model; returns its state (``bytes_sent``)."""
    state = GradExchange(compression, group)
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
