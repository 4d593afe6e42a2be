"""Training runs in FP32 and in HBFP8 on a device, with the same seed and hyperparameters
(``hbfp train``, ``make demo``, examples/train_digits.py), with SGD (momentum 0.9) or AdamW:

- classifiers on scikit-learn's bundled digits (8x8 images, 10 classes; no download): an MLP
  and a small CNN (``"mlp"``, ``"cnn"``; test accuracy);
- character-level language models on Python's own documentation (``pydoc_data.topics``, some
  450,000 characters of English and code that ship with every CPython; no download): an MLP
  over a 32-character context (``"charlm"``) and a 2-layer causal transformer (``"transformer"``;
  validation loss in nats per character).

- your own model and data (``"MODULE:FACTORY"``, ``load_task``): ``FACTORY()`` returns the
  model, training and test sets, and optionally the loss and the metric (``Task``).

Everything but the matrix products runs in fp32 on the CPU; in HBFP8 every product of the
forward pass and both products of the backward pass run on the device (``hbfp.torch.convert``
for the layers, ``hbfp.torch.offload`` for the rest, such as attention), under a recipe
(``hbfp.torch.RECIPES``; default "default": gradients rounded stochastically, seeded by the
run's seed), and the master weights are kept as HBFP16 by default (wide weight storage,
``hbfp.torch.wide_weight_storage``; ``weight_storage="fp32"`` keeps fp32 ones).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where it runs: the CLI builds its parser without it
    import torch

__all__ = ["Run", "Task", "TaskError", "load_digits_split", "load_task", "load_text_split", "make_model", "train",
           "write_report"]

CLASSIFIERS = ("mlp", "cnn")
LANGUAGE_MODELS = ("charlm", "transformer")
MODELS = CLASSIFIERS + LANGUAGE_MODELS
OPTIMIZERS = ("sgd", "adamw")
WEIGHT_STORAGE = ("hbfp16", "fp32")
#: Learning rates per optimizer (the same for FP32 and HBFP8 runs).
LEARNING_RATES = {"sgd": 0.1, "adamw": 3e-3}
#: Language models: characters of context, steps per epoch, batch size; the validation set.
CONTEXT = {"charlm": 32, "transformer": 48}
LM_STEPS_PER_EPOCH = 200
#: ``hbfp train``'s epochs per model; your own model's (``--model``): ``TASK_EPOCHS``.
DEFAULT_EPOCHS = {"mlp": 10, "cnn": 10, "charlm": 5, "transformer": 5}
TASK_EPOCHS = 10
#: The results a run records: "accuracy" (test accuracy) or "loss" (the mean loss on the test
#: or validation data).
METRICS = ("accuracy", "loss")
#: Your own model's batches: the training batch (as the digits'), the evaluation chunk.
TASK_BATCH = 64
EVAL_BATCH = 256
LM_BATCH = 64
LM_VAL_WINDOWS = 2048


@dataclass
class Run:
    model: str
    precision: str  # "fp32" or "hbfp8"
    device: str | None
    epochs: int
    seed: int
    weight_storage: str = "fp32"  # master weights: "fp32", or "hbfp16" (wide weight storage)
    optimizer: str = "sgd"
    recipe: str | None = None  # the hbfp.torch recipe of an HBFP8 run
    metric: str = "accuracy"  # METRICS: what test_accuracies or val_losses record
    val_losses: list[float] = field(default_factory=list)  # language models: per epoch (nats/char)
    val_loss: float = float("nan")  # language models: after the last epoch
    losses: list[float] = field(default_factory=list)  # mean training loss per epoch (this rank's batches)
    batch_losses: list[float] = field(default_factory=list)
    test_accuracies: list[float] = field(default_factory=list)  # per epoch
    test_accuracy: float = float("nan")  # after the last epoch
    seconds: float = 0.0
    step_seconds: float = 0.0  # the median training step (forward, backward, exchange, update) on rank 0
    # data-parallel runs (hbfp.distributed): ranks, the gradient exchange (its compression,
    # steps, error feedback, overlap with backward), the bytes rank 0 sent in it and what a
    # fp32 ring all-reduce of the same buckets sends, and whether the ranks ended with the
    # same parameters bit for bit
    nproc: int = 1
    grad_compression: str = "none"
    grad_exchange: str | None = None
    error_feedback: bool = False
    grad_overlap: bool | None = None
    allreduce_bytes: int = 0
    allreduce_bytes_fp32_ring: int = 0
    params_equal_across_ranks: bool | None = None

    @property
    def final_accuracy(self) -> float:
        return self.test_accuracy


def load_digits_split(seed: int = 0, test_share: float = 0.25):
    """(x_train, y_train, x_test, y_test) as torch tensors; pixels scaled to [0, 1]."""
    import torch

    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_share)
    test, train_idx = order[:n_test], order[n_test:]
    return (torch.from_numpy(x[train_idx]), torch.from_numpy(y[train_idx]),
            torch.from_numpy(x[test]), torch.from_numpy(y[test]))


def load_text_split(val_share: float = 0.1):
    """(train, validation) character indices of Python's documentation (``pydoc_data``) and
    the vocabulary (sorted characters); the last ``val_share`` of the text is the validation
    set."""
    import torch

    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n = int(len(data) * (1 - val_share))
    return data[:n], data[n:], chars


#: The keys a factory's dict may have (the first three it must have).
TASK_KEYS = ("model", "train", "test", "loss", "metric")


class TaskError(ValueError):
    """A ``MODULE:FACTORY`` that gives no trainable task: the module or the factory is missing,
    it fails, or it returns something other than ``Task``'s fields (one line: what and where)."""


@dataclass
class Task:
    """Your own model and data, from ``FACTORY()`` of ``load_task("MODULE:FACTORY")``: ``model``
    (an ``nn.Module``), ``train`` and ``test`` (map-style torch Datasets of ``(x, y)`` pairs),
    ``loss`` (``loss(output, y)`` -> a scalar tensor; None: cross-entropy over the output's last
    dimension) and ``metric`` ("accuracy": the share of ``output.argmax(-1) == y``, the default
    with cross-entropy; "loss": the mean loss over ``test``, the default with your own loss).
    ``name`` is the spec; every run starts from a copy of ``model``."""

    name: str
    model: torch.nn.Module
    train: object
    test: object
    loss: Callable | None = None
    metric: str = "accuracy"

    def loss_of(self, out, y):
        return _cross_entropy(out, y) if self.loss is None else self.loss(out, y)


def _cross_entropy(out, y):
    import torch

    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def check_task_spec(spec: str) -> str:
    """``spec`` if it reads ``MODULE:FACTORY`` (a dotted module, a name); ``TaskError`` otherwise."""
    if not _SPEC.match(spec):
        raise TaskError(f"expected MODULE:FACTORY (e.g. examples.my_model:build), got {spec!r}")
    return spec


def _where(error: BaseException) -> str:
    """`` (FILE, line N)``: the innermost frame of ``error``'s traceback in the user's code (not
    this module, the standard library or an installed package); empty if there is none."""
    import sysconfig
    import traceback

    installed = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "purelib", "platlib"))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith("<") and Path(f.filename).resolve() != Path(__file__).resolve()
              and not str(Path(f.filename).resolve()).startswith(installed)]
    return f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""


def load_task(spec: str, seed: int = 0) -> Task:
    """Import ``MODULE`` of ``spec`` ("MODULE:FACTORY"), call ``FACTORY()`` after
    ``torch.manual_seed(seed)`` and check what it returned (``TASK_KEYS``), including one forward
    pass and loss of a copy of the model on two training samples: ``TaskError`` (one line) for
    anything that would stop a training later."""
    import torch

    module_name, _, factory_name = check_task_spec(spec).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):  # the module itself (or its package)
            raise TaskError(f"no module {e.name!r} to import (run from the folder that holds it, or add that folder "
                            "to PYTHONPATH)") from None
        raise TaskError(f"importing {module_name} failed: {type(e).__name__}: {e}{_where(e)}") from None
    except Exception as e:  # noqa: BLE001 - the user's module: one line, where it failed
        raise TaskError(f"importing {module_name} failed: {type(e).__name__}: {e}{_where(e)}") from None
    factory = getattr(module, factory_name, None)
    if factory is None:
        functions = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                           and v.__module__ == module.__name__)
        raise TaskError(f"module {module_name} has no {factory_name!r}"
                        + (f" (its functions: {', '.join(functions[:8])}{', ...' if len(functions) > 8 else ''})"
                           if functions else ""))
    if not callable(factory):
        raise TaskError(f"{factory_name} is not callable ({type(factory).__name__}): FACTORY is a function that "
                        "returns the model and its data")
    torch.manual_seed(seed)
    try:
        got = factory()
    except Exception as e:  # noqa: BLE001
        raise TaskError(f"{factory_name}() raised {type(e).__name__}: {e}{_where(e)}") from None
    want = "a dict with model, train and test (and optionally loss, metric)"
    if not isinstance(got, Mapping):
        raise TaskError(f"{factory_name}() returned {type(got).__name__}, not {want}")
    missing = [k for k in TASK_KEYS[:3] if k not in got]
    unknown = [str(k) for k in got if k not in TASK_KEYS]
    if missing or unknown:
        raise TaskError(f"{factory_name}() returned a dict " + (f"without {', '.join(missing)}" if missing else "")
                        + (" and " if missing and unknown else "")
                        + (f"with unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "") + f": expected {want}")
    model, loss, metric = got["model"], got.get("loss"), got.get("metric")
    if not isinstance(model, torch.nn.Module):
        raise TaskError(f"{factory_name}()['model'] is a {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise TaskError(f"{factory_name}()['model'] has no parameters to train")
    for key in ("train", "test"):
        _check_dataset(got[key], f"{factory_name}()[{key!r}]")
    if loss is not None and not callable(loss):
        raise TaskError(f"{factory_name}()['loss'] is a {type(loss).__name__}, not a function loss(output, y)")
    if metric is None:
        metric = "accuracy" if loss is None else "loss"
    if metric not in METRICS:
        raise TaskError(f"{factory_name}()['metric'] must be one of {', '.join(METRICS)}, got {metric!r}")
    task = Task(spec, model, got["train"], got["test"], loss, metric)
    _check_batch(task, f"{factory_name}()")
    return task


def _check_dataset(data, what: str) -> None:
    from torch.utils.data import IterableDataset

    if isinstance(data, IterableDataset) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TaskError(f"{what} is a {type(data).__name__}, not a map-style torch Dataset (len() and [i]), "
                        "e.g. a TensorDataset")
    if len(data) == 0:
        raise TaskError(f"{what} is empty")
    try:
        first = data[0]
    except Exception as e:  # noqa: BLE001
        raise TaskError(f"{what}[0] raised {type(e).__name__}: {e}{_where(e)}") from None
    if not isinstance(first, (tuple, list)) or len(first) != 2:
        raise TaskError(f"{what}[0] is {type(first).__name__}"
                        + (f" of {len(first)}" if isinstance(first, (tuple, list)) else "") + ", not a pair (x, y)")


def _check_batch(task: Task, what: str) -> None:
    """One forward pass of a copy of the model (eval mode, no gradients) on the first two
    training samples, its loss and its metric: a model that does not take the data says so now."""
    import torch

    model = copy.deepcopy(task.model).eval()
    x, y = _fetch(task.train, torch.arange(min(2, len(task.train))))
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as e:  # noqa: BLE001
        raise TaskError(f"{what}: the model fails on a batch of 'train': {type(e).__name__}: "
                        f"{_first_line(e)}{_where(e)}") from None
    try:
        with torch.no_grad():
            loss = task.loss_of(out, y)
    except Exception as e:  # noqa: BLE001
        raise TaskError(f"{what}: the loss fails on the model's output {tuple(getattr(out, 'shape', ()))} and y "
                        f"{tuple(getattr(y, 'shape', ()))}: {type(e).__name__}: {_first_line(e)}{_where(e)}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TaskError(f"{what}: the loss returned {type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                        + ", not a scalar tensor")
    if task.metric == "accuracy" and (not isinstance(out, torch.Tensor) or out.shape[:-1] != y.shape):
        raise TaskError(f"{what}: metric 'accuracy' compares output.argmax(-1) with y, but the output's shape "
                        f"{tuple(getattr(out, 'shape', ()))} and y's {tuple(y.shape)} do not match (return labels, or "
                        "metric 'loss')")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _fetch(data, idx: torch.Tensor):
    """(x, y) of the samples ``idx`` of a dataset: a TensorDataset indexed at once, any other
    map-style dataset sample by sample, stacked as a DataLoader would (``default_collate``)."""
    from torch.utils.data import TensorDataset, default_collate

    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return data.tensors[0][idx], data.tensors[1][idx]
    x, y = default_collate([tuple(data[int(i)]) for i in idx])
    return x, y


def _windows(data: torch.Tensor, starts: torch.Tensor, ctx: int) -> torch.Tensor:
    import torch

    return data[starts[:, None] + torch.arange(ctx + 1)[None, :]]


@functools.lru_cache(maxsize=None)
def _causal_transformer():
    """The class of the character transformer (torch is imported where a model is made)."""
    import torch

    class CausalTransformer(torch.nn.Module):
        """A 2-layer causal transformer over characters: embeddings (d 64) and learned positions,
        two pre-norm encoder layers (4 heads, feed-forward 128) under a causal mask, a linear head;
        the next character at every position."""

        def __init__(self, vocab: int, ctx: int, d: int = 64, layers: int = 2):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.randn(ctx, d) * 0.02)
            layer = torch.nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, vocab)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

        def forward(self, x):
            h = self.embed(x) + self.pos[: x.shape[1]]
            h = self.layers(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
            return self.head(self.norm(h))

    return CausalTransformer


def make_model(kind: str, seed: int, vocab: int | None = None) -> torch.nn.Module:
    import torch

    torch.manual_seed(seed)
    if kind == "charlm":
        ctx = CONTEXT[kind]
        return torch.nn.Sequential(torch.nn.Embedding(vocab, 24), torch.nn.Flatten(), torch.nn.Linear(ctx * 24, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, vocab))
    if kind == "transformer":
        return _causal_transformer()(vocab, CONTEXT[kind])
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


def train(kind: str | Task, precision: str, *, device=None, device_name: str | None = None, epochs: int = 10,
          seed: int = 0, batch_size: int | None = None, lr: float | None = None, max_batches: int | None = None,
          progress: bool = True, weight_storage: str = "hbfp16", grad_compression: str = "none",
          grad_exchange: str = "two_step", error_feedback: bool = False, grad_overlap: bool = True,
          optimizer: str = "sgd", recipe=None) -> Run:
    """Train ``kind`` (``MODELS``, or your own ``Task`` from ``load_task``) in ``precision``
    ("fp32" or "hbfp8" on ``device``) with ``optimizer`` ("sgd": momentum 0.9; "adamw": weight
    decay 0.01) at ``lr`` (default ``LEARNING_RATES``); ``weight_storage`` ("hbfp16" or "fp32")
    and ``recipe`` (default "default", seeded with ``seed``) apply to HBFP8 runs (FP32 runs keep
    fp32). An epoch is a pass over the digits or a task's training set (batches of
    ``batch_size``, default 64, in an order drawn from ``seed``) or ``LM_STEPS_PER_EPOCH``
    batches of ``LM_BATCH`` random windows of the text; ``max_batches`` cuts an epoch short. A
    task's run starts from a copy of its model; in HBFP8 every product of its steps runs on the
    device (``hbfp.torch.offload``), and after each epoch its metric is measured on its test set
    in chunks of ``EVAL_BATCH``.

    Inside an initialized torch.distributed process group of N ranks the run is data-parallel:
    every rank trains a DDP replica on its share of each batch (split in N contiguous parts),
    the gradients exchanged by ``hbfp.distributed`` with ``grad_compression`` ("none",
    "hbfp8", "mxint8"), ``grad_exchange`` ("two_step" or "gather"), ``error_feedback`` and
    ``grad_overlap`` (``GradExchange``); every rank evaluates the whole test set and the run records the bytes
    each rank sent and whether the ranks ended equal."""
    import contextlib

    import torch

    task = kind if isinstance(kind, Task) else None
    if task is None and kind not in MODELS:
        raise ValueError(f"model must be one of {MODELS} or a Task, got {kind!r}")
    if precision not in ("fp32", "hbfp8"):
        raise ValueError(f"precision must be fp32 or hbfp8, got {precision!r}")
    if weight_storage not in WEIGHT_STORAGE:
        raise ValueError(f"weight_storage must be one of {WEIGHT_STORAGE}, got {weight_storage!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if precision == "fp32":
        weight_storage = "fp32"
    import torch.distributed as dist

    import hbfp.torch as ht
    from hbfp import distributed as hd
    from hbfp import recipes

    if grad_compression not in hd.COMPRESSIONS:
        raise ValueError(f"grad_compression must be one of {hd.COMPRESSIONS}, got {grad_compression!r}")
    if grad_exchange not in hd.EXCHANGES:
        raise ValueError(f"grad_exchange must be one of {hd.EXCHANGES}, got {grad_exchange!r}")
    if error_feedback and grad_compression == "none":
        raise ValueError("error_feedback needs a compressed exchange (grad_compression hbfp8 or mxint8)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0

    # Bit-reproducible CPU math: the fp32 parts of an emu run and a sim run must agree.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    name = task.name if task is not None else kind
    lm = kind in LANGUAGE_MODELS
    if task is not None:
        model = copy.deepcopy(task.model)  # every run from the same initial weights
        torch.manual_seed(seed)  # the model's own randomness (dropout), the same in every run
    elif lm:
        text, val_text, chars = load_text_split()
        model = make_model(kind, seed, len(chars))
    else:
        x_train, y_train, x_test, y_test = load_digits_split(seed)
        model = make_model(kind, seed)
    hbfp8 = precision == "hbfp8"
    r = recipes.resolve(recipe).with_seed(seed) if hbfp8 else None
    # the transformer's attention is no layer that convert swaps, nor may a task's products be:
    # their whole step runs under offload
    routed = hbfp8 and (kind == "transformer" or task is not None)
    if hbfp8 and not routed:
        ht.convert(model, device, recipe=r)
    lr = LEARNING_RATES[optimizer] if lr is None else lr
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if weight_storage == "hbfp16":
        ht.wide_weight_storage(model, opt)
    exchange = None
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        exchange = hd.attach(model, grad_compression, exchange=grad_exchange, error_feedback=error_feedback,
                             overlap=grad_overlap)
    metric = task.metric if task is not None else ("loss" if lm else "accuracy")
    compressed = world > 1 and grad_compression != "none"
    run = Run(name, precision, device_name, epochs, seed, weight_storage, nproc=world,
              grad_compression=grad_compression if world > 1 else "none", optimizer=optimizer,
              grad_exchange=grad_exchange if compressed else None, error_feedback=compressed and error_feedback,
              grad_overlap=grad_overlap if world > 1 else None, recipe=r.name if r is not None else None,
              metric=metric)
    gen = torch.Generator().manual_seed(seed)
    batch_size = batch_size or (LM_BATCH if lm else TASK_BATCH)
    context = ht.offload(device, recipe=r) if routed else contextlib.nullcontext()
    t0 = time.perf_counter()
    steps = []
    with context:
        for epoch in range(epochs):
            model.train()
            if lm:
                ctx = CONTEXT[kind]
                batches = [torch.randint(0, len(text) - ctx - 1, (batch_size,), generator=gen)
                           for _ in range(LM_STEPS_PER_EPOCH)]
            else:
                order = torch.randperm(len(task.train) if task is not None else len(x_train), generator=gen)
                batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
            if max_batches is not None:
                batches = batches[:max_batches]
            it = batches
            if progress and sys.stderr.isatty():  # a bar on a terminal; a line per epoch elsewhere
                from tqdm import tqdm

                it = tqdm(batches, desc=f"{name} {precision} {optimizer} epoch {epoch + 1}/{epochs}", leave=False,
                          unit="batch")
            total = 0.0
            for idx in it:
                if world > 1:
                    idx = torch.tensor_split(idx, world)[rank]  # this rank's share of the batch
                t_step = time.perf_counter()
                opt.zero_grad()
                if task is not None:
                    x, y = _fetch(task.train, idx)
                    loss = task.loss_of(model(x), y)
                else:
                    loss = _loss(kind, model, *(_lm_batch(kind, text, idx) if lm else (x_train[idx], y_train[idx])))
                loss.backward()
                opt.step()
                steps.append(time.perf_counter() - t_step)
                value = float(loss.detach())
                run.batch_losses.append(value)
                total += value
            run.losses.append(total / len(batches))
            model.eval()
            with torch.no_grad():
                if task is not None:
                    result = _evaluate(task, model)
                    (run.test_accuracies if metric == "accuracy" else run.val_losses).append(result)
                elif lm:
                    run.val_losses.append(_val_loss(kind, model, val_text))
                else:
                    pred = model(x_test).argmax(1)
                    run.test_accuracies.append(float((pred == y_test).float().mean()))
            if progress and not sys.stderr.isatty():
                result = (f"test accuracy {100 * run.test_accuracies[-1]:.2f}%" if run.test_accuracies
                          else f"validation loss {run.val_losses[-1]:.4f}")
                print(f"{name} {precision} {optimizer} epoch {epoch + 1}/{epochs}: training loss "
                      f"{run.losses[-1]:.4f}, {result}", file=sys.stderr, flush=True)
    run.seconds = time.perf_counter() - t0
    run.step_seconds = statistics.median(steps) if steps else 0.0
    run.test_accuracy = run.test_accuracies[-1] if run.test_accuracies else float("nan")
    run.val_loss = run.val_losses[-1] if run.val_losses else float("nan")
    if exchange is not None:
        run.allreduce_bytes = exchange.bytes_sent
        run.allreduce_bytes_fp32_ring = exchange.bytes_fp32_ring
        run.params_equal_across_ranks = hd.params_equal(model)
    return run


def _evaluate(task: Task, model) -> float:
    """A task's metric on its whole test set, in chunks of ``EVAL_BATCH``: the share of
    ``output.argmax(-1) == y`` ("accuracy") or the mean loss per sample ("loss")."""
    import torch

    total, count = 0.0, 0
    for idx in torch.split(torch.arange(len(task.test)), EVAL_BATCH):
        x, y = _fetch(task.test, idx)
        out = model(x)
        if task.metric == "accuracy":
            total += float((out.argmax(-1) == y).sum())
            count += y.numel()
        else:
            total += float(task.loss_of(out, y)) * len(idx)
            count += len(idx)
    return total / count


def _lm_batch(kind: str, text: torch.Tensor, starts: torch.Tensor):
    w = _windows(text, starts, CONTEXT[kind])
    if kind == "charlm":  # the character after the context
        return w[:, :-1], w[:, -1]
    return w[:, :-1], w[:, 1:]  # every position's next character


def _loss(kind: str, model, x, y):
    import torch

    out = model(x)
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _val_loss(kind: str, model, val_text: torch.Tensor) -> float:
    """Mean cross-entropy (nats per character) over ``LM_VAL_WINDOWS`` windows evenly spread
    over the validation text, in chunks of 256."""
    import torch

    ctx = CONTEXT[kind]
    starts = torch.linspace(0, len(val_text) - ctx - 2, LM_VAL_WINDOWS).to(torch.int64)
    total = 0.0
    for chunk in torch.split(starts, 256):
        total += float(_loss(kind, model, *_lm_batch(kind, val_text, chunk))) * len(chunk)
    return total / len(starts)


def _metric(r: Run) -> str:
    """The table's result of a run: test accuracy (classifiers, tasks measuring accuracy) or the
    loss on the validation text (LMs) or on the test set (tasks measuring the loss)."""
    if r.metric == "loss":
        return f"{'val' if r.model in LANGUAGE_MODELS else 'test'} loss {r.val_loss:.4f}"
    return f"{100 * r.final_accuracy:.2f}%"


#: What ``write_report`` writes into its folder, and its record of them there (``hbfp.outputs``).
REPORT_FILES = ("curves.png", "results.md", "runs.json")
MANIFEST = ".hbfp-train.json"


def report_output(outdir: Path):
    """The folder ``write_report`` writes into, checked before any training (``hbfp.outputs``:
    ``OutputConflict`` if a file is in the way, or it holds report files of the user's)."""
    from hbfp.outputs import Output

    return Output(outdir, REPORT_FILES, command="hbfp train", manifest=MANIFEST)


def results_table(runs: list[Run]) -> list[str]:
    """The markdown table of ``runs`` (results.md's, and README's demo table: its lines)."""
    lines = ["| model | optimizer | products | master weights | device | epochs | final loss | result | seconds |",
             "|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in runs:
        products = r.precision + (f" ({r.recipe})" if r.recipe else "")
        lines.append(f"| {r.model} | {r.optimizer} | {products} | {r.weight_storage} | {r.device or 'CPU'} | {r.epochs} | "
                     f"{r.losses[-1]:.4f} | {_metric(r)} | {r.seconds:.1f} |")
    return lines


def load_runs(path: Path) -> list[Run]:
    """The runs of a ``runs.json`` that ``write_report`` wrote."""
    from dataclasses import fields

    names = {f.name for f in fields(Run)}
    return [Run(**{k: v for k, v in d.items() if k in names}) for d in json.loads(Path(path).read_text())]


def curve_panels(runs: list[Run]) -> list[tuple[str, str, str]]:
    """The panels of ``write_report``'s curves, (Run field, title, y label): the training loss
    always, the test accuracy and the validation loss where a run measured them (a ``--model``
    task measured by accuracy has no validation loss: no empty panel)."""
    demo = all(r.model in MODELS for r in runs)
    panels = [("losses", "training loss", "cross-entropy" if demo else "loss")]
    if any(r.test_accuracies for r in runs):
        panels.append(("test_accuracies", "test accuracy (digits)" if demo else "test accuracy", "%"))
    if any(r.val_losses for r in runs):
        panels.append(("val_losses", "validation loss (text)" if demo else "validation / test loss",
                       "nats per character" if demo else "loss"))
    return panels


def curve_styles(runs: list[Run]) -> list[dict]:
    """Each run's line in the curves (matplotlib keywords): one colour per model, a line style
    per precision (fp32 solid, HBFP on emu dashed, on another device dotted), a marker per
    optimizer, and its label."""
    import matplotlib

    models = list(dict.fromkeys(r.model for r in runs))
    palette = matplotlib.colormaps["tab10" if len(models) <= 10 else "tab20"]
    optimizers = list(dict.fromkeys(r.optimizer for r in runs))
    markers = "os^Dvx*P"
    styles = []
    for r in runs:
        label = f"{r.model} {r.optimizer} {r.precision}" + (f" ({r.device})" if r.device else "")
        if r.precision != "fp32" and r.weight_storage != "fp32":
            label += f", {r.weight_storage} weights"
        styles.append(dict(color=palette(models.index(r.model) % palette.N),
                           marker=markers[optimizers.index(r.optimizer) % len(markers)], markersize=4,
                           linestyle="-" if r.precision == "fp32" else
                           "--" if (r.device or "emu").startswith("emu") else ":", label=label))
    return styles


def write_report(runs: list[Run], outdir: Path, extra: list[str] | None = None, output=None) -> str:
    """Write curves (PNG), a markdown table and the runs (JSON) under ``outdir`` (through
    ``output``, a ``report_output`` of it checked earlier; default: checked now); return the
    table."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    output = output if output is not None else report_output(Path(outdir))
    panels, styles = curve_panels(runs), curve_styles(runs)
    columns = max(1, min(4, len(runs)))
    legend = 0.3 * -(-len(runs) // columns) + 0.2  # inches below the panels for the legend's rows
    fig, axes = plt.subplots(1, len(panels), figsize=(5.7 * len(panels), 4.8 + legend), squeeze=False)
    axes = axes[0]
    for r, style in zip(runs, styles):
        for ax, (field, _, _) in zip(axes, panels):
            values = getattr(r, field)
            if values:
                ax.plot(range(1, len(values) + 1), [100 * v for v in values] if field == "test_accuracies" else values,
                        **style)
    for ax, (_, title, ylabel) in zip(axes, panels):
        ax.set(title=title, xlabel="epoch", ylabel=ylabel)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, legend / (4.8 + legend), 1, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)

    table = "\n".join(results_table(runs) + [""] + (extra or []))
    output.write({"curves.png": png.getvalue(), "results.md": table + "\n",
                  "runs.json": json.dumps([asdict(r) for r in runs], indent=1)})
    return table
