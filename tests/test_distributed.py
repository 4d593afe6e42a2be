"""hbfp.distributed: data-parallel training on torch.distributed (2 ranks over gloo, spawned
here), the gradient exchange against its definition, and `hbfp train --nproc 2` end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hbfp import distributed as hd
from hbfp.golden import HBFP8, MXINT8, quantize


def test_rank_spec_puts_the_rank_into_a_device_spec():
    assert hd.rank_spec("emu", 3) == "emu"
    assert hd.rank_spec("tcp:127.0.0.1:{7000+rank}", 1) == "tcp:127.0.0.1:7001"
    assert hd.rank_spec("tcp:h:{rank + 7000}", 2) == "tcp:h:7002"
    assert hd.rank_spec("serial:/dev/ttyUSB{rank}", 0) == "serial:/dev/ttyUSB0"
    with pytest.raises(ValueError, match="braces"):
        hd.rank_spec("tcp:h:{port}", 0)


def _ranks(fn, world, *args):
    """Run ``fn(rank, world, port, *args)`` on ``world`` spawned ranks."""
    mp.spawn(fn, args=(world, hd.free_port(), *args), nprocs=world, join=True)


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _gradient(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())
    x[:5] = 0.0
    return x


def _exchange_rank(rank, world, port, compression, kind, n, out):
    _init(rank, world, port)
    try:
        state = hd.GradExchange(compression, exchange=kind)
        flat = _gradient(rank, n)
        state.exchange(flat)
        torch.save({"result": flat, "bytes": state.bytes_sent, "ring": state.bytes_fp32_ring},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _two_step_definition(grads, fmt, n, world, exchange=1):
    """The two-step exchange written out with the golden model: each rank's bucket quantized
    to nearest; shard j (whole tiles, the first shards one tile more) summed over the ranks in
    rank order, its sum quantized stochastically (``shard_seed`` of the exchange's number and the shard), all
    dequantized and divided by the number of ranks."""
    width, tile_rows = fmt.tile[1], fmt.tile[0]
    rows = -(-n // width)
    deq = []
    for g in grads:
        m = np.zeros(rows * width, np.float32)
        m[:n] = g.numpy()
        deq.append(quantize(m.reshape(rows, width), fmt).dequantize())
    tiles = -(-rows // tile_rows)
    per = [tiles // world + (j < tiles % world) for j in range(world)]
    out, start = [], 0
    for j, t in enumerate(per):
        end = min(start + t * tile_rows, rows)
        if end > start:
            total = deq[0][start:end]
            for d in deq[1:]:
                total = (total + d[start:end]).astype(np.float32)
            out.append(quantize(total, fmt.with_rounding("stochastic"), seed=hd.shard_seed(exchange, j)).dequantize())
        start = end
    return (np.concatenate(out).reshape(-1)[:n] / np.float32(world)).astype(np.float32), per


@pytest.mark.parametrize("compression,kind,world", [("none", "two_step", 2), ("hbfp8", "gather", 2),
                                                    ("mxint8", "gather", 2), ("hbfp8", "two_step", 2),
                                                    ("hbfp8", "two_step", 3), ("mxint8", "two_step", 3)])
def test_the_exchange_is_its_definition_on_every_rank(tmp_path, compression, kind, world):
    n = 1000 if compression == "mxint8" else 3000  # not a whole number of tiles: padded with zeros
    _ranks(_exchange_rank, world, compression, kind, n, str(tmp_path))
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in range(1, world):  # bit for bit on every rank
        assert torch.equal(got[0]["result"].view(torch.int32), got[r]["result"].view(torch.int32))
    ring = 2 * (world - 1) * 4 * n // world
    assert all(g["ring"] == ring for g in got)
    grads = [_gradient(r, n) for r in range(world)]
    if compression == "none":
        want = sum(grads[1:], grads[0]) / world
        assert torch.allclose(got[0]["result"], want, rtol=1e-6, atol=0)
        assert got[0]["bytes"] == ring
        return
    fmt = HBFP8 if compression == "hbfp8" else MXINT8
    width = fmt.tile[1]
    rows = -(-n // width)
    tiles = -(-rows // fmt.tile[0]) * (width // fmt.tile[1])
    if kind == "gather":
        total = None
        for g in grads:  # quantize each rank's bucket, dequantize, add in rank order, divide
            m = np.zeros(rows * width, np.float32)
            m[:n] = g.numpy()
            d = quantize(m.reshape(rows, width), fmt).dequantize().reshape(-1)[:n]
            total = d if total is None else (total + d).astype(np.float32)
        want = (total / np.float32(world)).astype(np.float32)
        assert got[0]["bytes"] == (world - 1) * (rows * width + tiles)  # a byte a code, one an exponent
    else:
        want, per = _two_step_definition(grads, fmt, n, world)
        for r in range(world):  # the others' shards out, then its own shard's sum to the others
            mine = min(per[r] * fmt.tile[0], rows - sum(per[:r]) * fmt.tile[0]) * width + per[r]
            assert got[r]["bytes"] == (rows * width + tiles - mine) + (world - 1) * mine
        assert ring / got[0]["bytes"] > 3.5
    assert np.array_equal(got[0]["result"].numpy().view(np.int32), want.view(np.int32))


def _sizes_rank(rank, world, port, sizes, out):
    _init(rank, world, port)
    try:
        state = hd.GradExchange("hbfp8")
        results = []
        for n in sizes:
            flat = _gradient(rank, n)
            results.append(state.exchange(flat, key=n).clone())
        torch.save(results, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_exchanges_of_other_sizes_after_each_other_are_each_their_definition(tmp_path):
    """The buffers an exchange keeps between exchanges, grown and reused by buckets of other
    sizes, leave each exchange its own result."""
    sizes = (3000, 1000, 5000, 2999)
    _ranks(_sizes_rank, 3, sizes, str(tmp_path))
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(3)]
    for i, n in enumerate(sizes):
        want, _ = _two_step_definition([_gradient(r, n) for r in range(3)], HBFP8, n, 3, exchange=i + 1)
        for r in range(3):
            assert np.array_equal(got[r][i].numpy().view(np.int32), want.view(np.int32)), (n, r)


def _train_rank(rank, world, port, precision, compression, out):
    _init(rank, world, port)
    try:
        from hbfp import host
        from hbfp import train as tr

        run = tr.train("mlp", precision, device=host.open("emu") if precision == "hbfp8" else None,
                       device_name="emu", epochs=1, max_batches=6, progress=False, grad_compression=compression)
        (tmp := os.path.join(out, f"{rank}.json")) and open(tmp, "w").write(json.dumps(
            {"batch_losses": run.batch_losses, "equal": run.params_equal_across_ranks, "bytes": run.allreduce_bytes,
             "nproc": run.nproc}))
    finally:
        dist.destroy_process_group()
    hd.exit_rank(0)  # DDP leaves gloo's threads behind: no exit-time teardown


def test_without_compression_two_ranks_follow_one_process_on_the_combined_batch(tmp_path):
    from hbfp import train as tr

    _ranks(_train_rank, 2, "fp32", "none", str(tmp_path))
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["equal"] and ranks[0]["nproc"] == 2
    one = tr.train("mlp", "fp32", epochs=1, max_batches=6, progress=False)
    # each rank's loss is the mean over its half of the batch: their mean is the batch's loss,
    # step after step, up to the fp32 rounding of the two ways of summing
    both = [(a + b) / 2 for a, b in zip(ranks[0]["batch_losses"], ranks[1]["batch_losses"])]
    assert np.allclose(both, one.batch_losses, rtol=1e-5, atol=0)


def test_hbfp8_training_with_compressed_gradients_keeps_the_ranks_equal(tmp_path):
    _ranks(_train_rank, 2, "hbfp8", "hbfp8", str(tmp_path))
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["equal"] and ranks[1]["equal"]
    assert ranks[0]["bytes"] == ranks[1]["bytes"] > 0
    assert all(np.isfinite(ranks[0]["batch_losses"]))


def test_hbfp_train_nproc_2_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hbfp.cli", "train", "--nproc", "2", "--grad-compression", "mxint8",
                        "--models", "mlp", "--optimizers", "sgd", "--epochs", "1", "--sim-epochs", "0", "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads((out / "runs.json").read_text())
    assert [x["precision"] for x in runs] == ["fp32", "hbfp8"]
    for x in runs:
        assert x["nproc"] == 2 and x["grad_compression"] == "mxint8" and x["params_equal_across_ranks"] is True
        assert x["allreduce_bytes"] > 0 and 0.5 < x["test_accuracy"] <= 1.0
    assert "data-parallel on 2 ranks" in (out / "results.md").read_text()


def test_bad_options_are_refused(tmp_path):
    from hbfp import train as tr

    with pytest.raises(ValueError, match="grad_compression"):
        tr.train("mlp", "fp32", epochs=1, max_batches=1, progress=False, grad_compression="zip")
    r = subprocess.run([sys.executable, "-m", "hbfp.cli", "train", "--nproc", "0", "--sim-epochs", "0", "-o",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--nproc must be at least 1" in r.stderr


def test_hbfp_train_under_torchrun(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(hd.free_port()), "-m", "hbfp.cli", "train", "--grad-compression", "hbfp8", "--models", "mlp",
                        "--optimizers", "sgd", "--epochs", "1", "--sim-epochs", "0", "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads((out / "runs.json").read_text())
    assert all(x["nproc"] == 2 and x["params_equal_across_ranks"] is True for x in runs)


def test_hbfp_train_on_two_nodes_under_torchrun(tmp_path):
    """Two torchrun "nodes" (``--nnodes 2 --node-rank R``, one rank each) meeting at a c10d
    rendezvous endpoint, as two machines would: the two-step HBFP8 exchange keeps them equal."""
    port = hd.free_port()
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "hbfp-test", "-m", "hbfp.cli", "train", "--grad-compression", "hbfp8", "--models", "mlp",
               "--optimizers", "sgd", "--epochs", "1", "--sim-epochs", "0", "-o", str(tmp_path / f"node{node}")]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [n.communicate(timeout=600) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    for n, (_, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-2000:]
    written = [d for d in ("node0", "node1") if (tmp_path / d / "runs.json").exists()]
    assert len(written) == 1  # rank 0 writes the report, on whichever node it landed
    runs = json.loads((tmp_path / written[0] / "runs.json").read_text())
    assert all(x["nproc"] == 2 and x["params_equal_across_ranks"] is True and x["grad_exchange"] == "two_step"
               and x["allreduce_bytes_fp32_ring"] / x["allreduce_bytes"] > 3.5 for x in runs)


def _feedback_rank(rank, world, port, out):
    """Three exchanges of the same gradient with error feedback: what the first rounding
    dropped is added to the second gradient, and so on."""
    _init(rank, world, port)
    try:
        state = hd.GradExchange("hbfp8", error_feedback=True)
        results = []
        for _ in range(3):
            flat = _gradient(rank, 2000)
            results.append(state.exchange(flat, key=7).clone())
        torch.save(results, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_error_feedback_carries_what_rounding_dropped(tmp_path):
    """With error feedback, each rank quantizes its gradient plus its last residual (what its
    own quantization dropped): the sum of the exchanged means approaches the sum of the true
    means, where without it the same error repeats every time."""
    _ranks(_feedback_rank, 2, str(tmp_path))
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1]))  # ranks equal
    grads = [_gradient(r, 2000) for r in range(2)]
    true_mean = (grads[0] + grads[1]) / 2
    # the first exchange has no residual yet: it is the plain exchange's result
    _ranks(_exchange_rank, 2, "hbfp8", "two_step", 2000, str(tmp_path))
    plain = torch.load(tmp_path / "0.pt")["result"]
    assert torch.equal(got[0][0], plain)
    assert not torch.equal(got[0][1], plain)  # the residual went in
    # three steps: accumulated error with feedback well below three times one step's error
    with_feedback = (sum(got[0]) - 3 * true_mean).abs().sum()
    without = (3 * plain - 3 * true_mean).abs().sum()
    assert with_feedback < 0.7 * without


def _overlap_rank(rank, world, port, overlap, out):
    _init(rank, world, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
        state = hd.attach(ddp, "hbfp8", overlap=overlap)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
            opt.step()
        torch.save({"params": [p.detach().clone() for p in model.parameters()], "exchanges": state.exchanges,
                    "equal": hd.params_equal(model)}, os.path.join(out, f"{overlap}-{rank}.pt"))
    finally:
        dist.destroy_process_group()
    hd.exit_rank(0)


def test_overlapped_exchanges_give_the_bits_of_the_hook_s_own(tmp_path):
    """Buckets exchanged on the worker thread while backward goes on: the same parameters, bit
    for bit, as exchanges made in the hook itself, over several buckets and steps."""
    for overlap in (True, False):
        _ranks(_overlap_rank, 2, overlap, str(tmp_path))
    on, off = (torch.load(tmp_path / f"{o}-0.pt") for o in (True, False))
    assert on["equal"] and off["equal"] and on["exchanges"] == off["exchanges"] > 3
    assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))


def _ranks_of(launcher: subprocess.Popen, n: int, within: float = 60.0) -> list[int]:
    """The PIDs of the ranks ``hbfp train --nproc n`` started (its spawned children), once
    they are all there."""
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        except OSError:
            children = []
        ranks = []
        for pid in children:
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    ranks.append(int(pid))
            except OSError:
                pass
        if len(ranks) == n:
            return sorted(ranks)
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


def test_the_line_names_the_rank_that_caused_the_end_not_a_peer_that_aborted():
    """Ranks that ended in the same moment: a killed rank (SIGKILL) or one that failed with its own
    line is named before a peer that gloo aborted (SIGABRT) because it went away; a stopped rank
    before any (CI saw 'rank 0 died (SIGABRT)' for a SIGKILLed rank 1)."""
    from hbfp.cli import _why_ranks_ended as why

    assert why([(0, -6), (1, -9)], [], {}, 5) == "rank 1 died (SIGKILL)"
    assert why([(0, -6), (1, 1)], [], {1: "RuntimeError: boom"}, 5) == "rank 1 failed: RuntimeError: boom"
    assert why([(0, -6)], [1], {}, 5) == "rank 1 stopped answering: rank 0 gave up waiting for it after --timeout 5 s"
    assert why([(0, -6)], [], {}, 5) == "rank 0 died (SIGABRT)"
    assert why([(0, 2), (1, -6)], [], {}, 5) == "rank 0 exited with status 2"
    assert why([(1, -15), (0, -9)], [], {}, 5) == "rank 0 died (SIGKILL)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ranks' PIDs from /proc")
@pytest.mark.parametrize("signal_name", ["SIGSTOP", "SIGKILL"])
def test_a_rank_that_stops_or_dies_ends_the_training_with_one_line(tmp_path, signal_name):
    """``hbfp train --nproc 2 --timeout S``: a rank stopped (or killed) mid-training ends the
    run within S and a few seconds, exit 1, one line naming the rank, no traceback."""
    import signal
    import time

    launcher = subprocess.Popen([sys.executable, "-m", "hbfp.cli", "train", "--nproc", "2", "--timeout", "5",
                                 "--models", "mlp", "--optimizers", "sgd", "--epochs", "400", "--sim-epochs", "0",
                                 "-o", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = _ranks_of(launcher, 2)[1]
        time.sleep(8)  # torch imported, the training under way
        assert launcher.poll() is None, launcher.stderr.read()[-2000:]
        os.kill(victim, getattr(signal, signal_name))
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if launcher.poll() is None:
            launcher.kill()
    lines = [x for x in err.strip().splitlines() if x.startswith("hbfp train:")]
    assert launcher.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    want = "stopped answering" if signal_name == "SIGSTOP" else "died (SIGKILL)"
    assert want in lines[0] and "rank " in lines[0], lines
