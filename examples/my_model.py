"""Your own model and data in ``hbfp train``: FP32 against HBFP8 with the same seed, the table,
the curves and runs.json, without writing the comparison loop.

    hbfp train --model examples.my_model:build -o build/my_model    # from the project's folder
    hbfp train --model my_model:build --epochs 5 --optimizers adamw  # a copy in the current folder

``hbfp train --model MODULE:FACTORY`` imports MODULE (from the current folder, then PYTHONPATH),
seeds torch with ``--seed`` and calls ``FACTORY()`` once. It returns a dict:

- ``"model"``: a ``torch.nn.Module``; every run starts from a copy of it (the same weights);
- ``"train"``, ``"test"``: map-style torch Datasets of ``(x, y)`` pairs (here TensorDatasets);
- ``"loss"`` (optional): ``loss(output, y)`` -> a scalar tensor; default: cross-entropy over the
  output's last dimension;
- ``"metric"`` (optional): ``"accuracy"`` (the share of ``output.argmax(-1) == y``; the default
  with cross-entropy) or ``"loss"`` (the mean loss on ``test``; the default with your own loss).

In the HBFP8 runs every matrix product of a training step, forward and backward, runs on the
device (``hbfp.torch.offload``); everything else stays in fp32 on the host.
"""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset


def build():
    digits = load_digits()  # 1,797 images of 8x8 pixels that ship with scikit-learn: no download
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    test, train = order[:360], order[360:]
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.GELU(),
        torch.nn.Linear(96, 96), torch.nn.GELU(),
        torch.nn.Linear(96, 10),
    )
    return {"model": model, "train": TensorDataset(x[train], y[train]), "test": TensorDataset(x[test], y[test])}
