"""Training runs on scikit-learn's bundled digits (8x8 images, 10 classes; no download):
an MLP and a small CNN, in FP32 and in HBFP8 on a device, with the same seed and
hyperparameters (``hbfp train``, ``make demo``, examples/train_digits.py).

Everything but the matrix products runs in fp32 on the CPU; in HBFP8 every product of the
forward pass and both products of the backward pass run on the device
(``hbfp.torch.convert``), and the master weights are kept as HBFP16 by default (wide weight
storage, ``hbfp.torch.wide_weight_storage``; ``weight_storage="fp32"`` keeps fp32 ones).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["Run", "load_digits_split", "make_model", "train", "write_report"]

MODELS = ("mlp", "cnn")
WEIGHT_STORAGE = ("hbfp16", "fp32")


@dataclass
class Run:
    model: str
    precision: str  # "fp32" or "hbfp8"
    device: str | None
    epochs: int
    seed: int
    weight_storage: str = "fp32"  # master weights: "fp32", or "hbfp16" (wide weight storage)
    losses: list[float] = field(default_factory=list)  # mean training loss per epoch (this rank's batches)
    batch_losses: list[float] = field(default_factory=list)
    test_accuracies: list[float] = field(default_factory=list)  # per epoch
    test_accuracy: float = float("nan")  # after the last epoch
    seconds: float = 0.0
    # data-parallel runs (hbfp.distributed): ranks, the gradient exchange, the bytes each rank
    # sent in it, and whether the ranks ended with the same parameters bit for bit
    nproc: int = 1
    grad_compression: str = "none"
    allreduce_bytes: int = 0
    params_equal_across_ranks: bool | None = None

    @property
    def final_accuracy(self) -> float:
        return self.test_accuracy


def load_digits_split(seed: int = 0, test_share: float = 0.25):
    """(x_train, y_train, x_test, y_test) as torch tensors; pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_share)
    test, train_idx = order[:n_test], order[n_test:]
    return (torch.from_numpy(x[train_idx]), torch.from_numpy(y[train_idx]),
            torch.from_numpy(x[test]), torch.from_numpy(y[test]))


def make_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10),
        )
    raise ValueError(f"model must be one of {MODELS}, got {kind!r}")


def train(kind: str, precision: str, *, device=None, device_name: str | None = None, epochs: int = 10,
          seed: int = 0, batch_size: int = 64, lr: float = 0.1, max_batches: int | None = None,
          progress: bool = True, weight_storage: str = "hbfp16", grad_compression: str = "none") -> Run:
    """Train ``kind`` ("mlp" or "cnn") in ``precision`` ("fp32" or "hbfp8" on ``device``);
    ``weight_storage`` ("hbfp16" or "fp32") applies to HBFP8 runs (FP32 runs keep fp32).

    Inside an initialized torch.distributed process group of N ranks the run is data-parallel:
    every rank trains a DDP replica on its share of each batch of ``batch_size`` (the batch
    split in N contiguous parts), the gradients exchanged by ``hbfp.distributed`` with
    ``grad_compression`` ("none", "hbfp8", "mxint8"); every rank evaluates the whole test set
    and the run records the bytes each rank sent and whether the ranks ended equal."""
    if precision not in ("fp32", "hbfp8"):
        raise ValueError(f"precision must be fp32 or hbfp8, got {precision!r}")
    if weight_storage not in WEIGHT_STORAGE:
        raise ValueError(f"weight_storage must be one of {WEIGHT_STORAGE}, got {weight_storage!r}")
    if precision == "fp32":
        weight_storage = "fp32"
    import torch.distributed as dist

    import hbfp.torch as ht
    from hbfp import distributed as hd

    if grad_compression not in hd.COMPRESSIONS:
        raise ValueError(f"grad_compression must be one of {hd.COMPRESSIONS}, got {grad_compression!r}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0

    # Bit-reproducible CPU math: the fp32 parts of an emu run and a sim run must agree.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split(seed)
    model = make_model(kind, seed)
    if precision == "hbfp8":
        ht.convert(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if weight_storage == "hbfp16":
        ht.wide_weight_storage(model, opt)
    exchange = None
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        exchange = hd.attach(model, grad_compression)
    run = Run(kind, precision, device_name, epochs, seed, weight_storage, nproc=world,
              grad_compression=grad_compression if world > 1 else "none")
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if max_batches is not None:
            batches = batches[:max_batches]
        it = batches
        if progress:
            from tqdm import tqdm

            it = tqdm(batches, desc=f"{kind} {precision} epoch {epoch + 1}/{epochs}", leave=False, unit="batch")
        total = 0.0
        for idx in it:
            if world > 1:
                idx = torch.tensor_split(idx, world)[rank]  # this rank's share of the batch
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            value = float(loss.detach())
            run.batch_losses.append(value)
            total += value
        run.losses.append(total / len(batches))
        model.eval()
        with torch.no_grad():
            pred = model(x_test).argmax(1)
        run.test_accuracies.append(float((pred == y_test).float().mean()))
    run.seconds = time.perf_counter() - t0
    run.test_accuracy = run.test_accuracies[-1] if run.test_accuracies else float("nan")
    if exchange is not None:
        run.allreduce_bytes = exchange.bytes_sent
        run.params_equal_across_ranks = hd.params_equal(model)
    return run


def write_report(runs: list[Run], outdir: Path, extra: list[str] | None = None) -> str:
    """Write curves (PNG), a markdown table and the runs (JSON) under ``outdir``; return the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        label = f"{r.model} {r.precision}" + (f" ({r.device})" if r.device else "")
        if r.precision != "fp32" and r.weight_storage != "fp32":
            label += f", {r.weight_storage} weights"
        epochs = range(1, len(r.losses) + 1)
        axes[0].plot(epochs, r.losses, marker="o", label=label)
        axes[1].plot(epochs, [100 * a for a in r.test_accuracies], marker="o", label=label)
    axes[0].set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    axes[1].set(title="test accuracy", xlabel="epoch", ylabel="%")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(outdir / "curves.png", dpi=100)
    plt.close(fig)

    lines = ["| model | products | master weights | device | epochs | final loss | test accuracy | seconds |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r.model} | {r.precision} | {r.weight_storage} | {r.device or 'CPU'} | {r.epochs} | {r.losses[-1]:.4f} | "
                     f"{100 * r.final_accuracy:.2f}% | {r.seconds:.1f} |")
    table = "\n".join(lines + [""] + (extra or []))
    (outdir / "results.md").write_text(table + "\n")
    (outdir / "runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return table
