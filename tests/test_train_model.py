"""``hbfp train --model MODULE:FACTORY``: your own model and data get the demo's FP32 against
HBFP8 comparison (table, curves, runs.json); a factory that cannot give a training is refused
before any training, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hbfp import cli, host
from hbfp import train as tr

ROOT = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).parent / "hbfp"
HBFP = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "hbfp.cli"]

#: A user's module: an nn.Sequential on TensorDatasets of synthetic data (two classes).
MYMODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def build():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long()
    return {"model": nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2)),
            "train": TensorDataset(x[:192], y[:192]), "test": TensorDataset(x[192:], y[192:])}
"""


def _env(*paths) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, paths), str(ROOT),
                                                                       os.environ.get("PYTHONPATH")]))}


def test_your_own_model_trains_in_fp32_and_hbfp8(tmp_path):
    (tmp_path / "mymodel.py").write_text(MYMODEL)
    out = tmp_path / "out"
    r = subprocess.run([*HBFP, "train", "--model", "mymodel:build", "--epochs", "2", "--optimizers", "sgd",
                        "--sim-epochs", "0", "-o", str(out)], capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path), cwd=tmp_path.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads((out / "runs.json").read_text())
    assert [(x["model"], x["precision"], x["optimizer"], x["device"]) for x in runs] == [
        ("mymodel:build", "fp32", "sgd", None), ("mymodel:build", "hbfp8", "sgd", "emu")]
    fp32, hbfp8 = runs
    for x in runs:
        assert x["metric"] == "accuracy" and x["epochs"] == 2 and len(x["test_accuracies"]) == 2
        assert len(x["batch_losses"]) == 2 * 3  # 192 samples in batches of 64
        assert 0.5 < x["test_accuracy"] <= 1.0
    # the same start and batches, other arithmetic: close losses, not the same ones
    assert hbfp8["batch_losses"] != fp32["batch_losses"]
    assert np.allclose(hbfp8["batch_losses"], fp32["batch_losses"], rtol=0.05)
    assert hbfp8["recipe"] == "default" and hbfp8["weight_storage"] == "hbfp16"
    table = (out / "results.md").read_text()
    assert "| mymodel:build | sgd | hbfp8 (default) | hbfp16 | emu | 2 |" in table
    assert "mymodel:build sgd: HBFP8 test accuracy" in table and "target" not in table
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_example_runs_from_the_project_folder(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([*HBFP, "train", "--model", "examples.my_model:build", "--epochs", "1", "--optimizers", "adamw",
                        "-o", str(out)], capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads((out / "runs.json").read_text())
    assert [x["precision"] for x in runs] == ["fp32", "hbfp8"]  # --sim-epochs is 0 with --model
    assert all(x["model"] == "examples.my_model:build" and x["test_accuracy"] > 0.5 for x in runs)
    # the usual table and curves; piped (no terminal), a plain line per epoch and no progress bar
    assert "| examples.my_model:build | adamw | hbfp8 (default) |" in (out / "results.md").read_text()
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    log = r.stdout + r.stderr
    assert "epoch 1/1" in log and "\r" not in log and "it/s" not in log


def test_a_task_of_any_dataset_with_its_own_loss(tmp_path, monkeypatch):
    """A map-style Dataset that is no TensorDataset (batched by default_collate), a loss of
    one's own (the metric is then the test loss); the same run twice: the same losses."""
    (tmp_path / "regress_task.py").write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import Dataset

        class Points(Dataset):
            def __init__(self, n, seed):
                g = torch.Generator().manual_seed(seed)
                self.x = torch.randn(n, 6, generator=g)
                self.y = self.x @ torch.arange(1.0, 7.0) / 6
            def __len__(self):
                return len(self.x)
            def __getitem__(self, i):
                return self.x[i], self.y[i]

        def build():
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1), torch.nn.Flatten(0))
            return {"model": model, "train": Points(96, 1), "test": Points(40, 2),
                    "loss": torch.nn.functional.mse_loss}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = tr.load_task("regress_task:build", seed=3)
    assert task.metric == "loss" and task.name == "regress_task:build"
    dev = host.open("emu")
    runs = [tr.train(task, "hbfp8", device=dev, device_name="emu", epochs=2, seed=3, progress=False, lr=0.05)
            for _ in range(2)]
    assert runs[0].batch_losses == runs[1].batch_losses and len(runs[0].batch_losses) == 4
    assert runs[0].metric == "loss" and len(runs[0].val_losses) == 2 and np.isfinite(runs[0].val_loss)
    assert runs[0].test_accuracies == [] and tr._metric(runs[0]).startswith("test loss ")
    # every run starts from a copy: the task's own model is untouched
    fresh = tr.load_task("regress_task:build", seed=3)
    for a, b in zip(task.model.parameters(), fresh.model.parameters()):
        assert a.equal(b)


#: Factories that cannot give a training, and what the one line says.
BAD_FACTORIES = """
import torch
from torch.utils.data import IterableDataset, TensorDataset

x, y = torch.randn(8, 4), torch.tensor([0, 1] * 4)
data = TensorDataset(x, y)
model = lambda: torch.nn.Linear(4, 2)
not_a_function = 3

def raises():
    raise ValueError("no data today")

def a_list():
    return [model(), data, data]

def no_test():
    return {"model": model(), "train": data}

def typo():
    return {"model": model(), "train": data, "test": data, "metrics": "accuracy"}

def not_a_module():
    return {"model": "resnet", "train": data, "test": data}

class Stream(IterableDataset):
    def __iter__(self):
        return iter([(x[0], y[0])])

def a_stream():
    return {"model": model(), "train": Stream(), "test": data}

def empty():
    return {"model": model(), "train": TensorDataset(x[:0], y[:0]), "test": data}

def no_pairs():
    return {"model": model(), "train": TensorDataset(x), "test": data}

def wrong_shapes():
    return {"model": torch.nn.Linear(5, 2), "train": data, "test": data}

def loss_not_callable():
    return {"model": model(), "train": data, "test": data, "loss": "mse"}

def odd_metric():
    return {"model": model(), "train": data, "test": data, "metric": "f1"}

def accuracy_of_a_regression():
    return {"model": torch.nn.Linear(4, 1), "train": TensorDataset(x, x[:, :1]), "test": data,
            "loss": torch.nn.functional.l1_loss, "metric": "accuracy"}
"""

CASES = [
    ("no_such_module_for_hbfp:build", "no module 'no_such_module_for_hbfp' to import"),
    ("{m}:nothing", "has no 'nothing' (its functions: a_list, a_stream,"),
    ("{m}:not_a_function", "not_a_function is not callable (int): FACTORY is a function"),
    ("{m}:raises", "raises() raised ValueError: no data today ({m}.py, line "),
    ("{m}:a_list", "a_list() returned list, not a dict with model, train and test"),
    ("{m}:no_test", "no_test() returned a dict without test: expected a dict with model, train and test"),
    ("{m}:typo", "with unknown key(s) 'metrics'"),
    ("{m}:not_a_module", "['model'] is a str, not a torch.nn.Module"),
    ("{m}:a_stream", "['train'] is a Stream, not a map-style torch Dataset"),
    ("{m}:empty", "['train'] is empty"),
    ("{m}:no_pairs", "['train'][0] is tuple of 1, not a pair (x, y)"),
    ("{m}:wrong_shapes", "the model fails on a batch of 'train': RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("{m}:loss_not_callable", "['loss'] is a str, not a function loss(output, y)"),
    ("{m}:odd_metric", "['metric'] must be one of accuracy, loss, got 'f1'"),
    ("{m}:accuracy_of_a_regression", "metric 'accuracy' compares output.argmax(-1) with y"),
    ("broken_import_mod:build", "importing broken_import_mod failed: ModuleNotFoundError: No module named "
                                "'not_installed_anywhere' (broken_import_mod.py, line 2)"),
    ("raising_import_mod:build", "importing raising_import_mod failed: RuntimeError: half-written (raising_import_mod.py, "
                                 "line 3)"),
]


@pytest.mark.parametrize("spec, said", CASES, ids=[c[0].replace("{m}", "m") for c in CASES])
def test_a_factory_that_gives_no_training_is_refused_in_one_line(tmp_path, monkeypatch, capsys, spec, said):
    name = f"factories_{abs(hash(spec)) % 10**8}"  # a fresh module for each case: no cached import
    (tmp_path / f"{name}.py").write_text(BAD_FACTORIES)
    (tmp_path / "broken_import_mod.py").write_text("import os\nimport not_installed_anywhere\n")
    (tmp_path / "raising_import_mod.py").write_text("import os\n\nraise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("broken_import_mod", "raising_import_mod"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    out = tmp_path / "out"
    assert cli.main(["train", "--model", spec.format(m=name), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"hbfp train: --model {spec.format(m=name)}: ") and said.format(m=name) in err, err
    assert not out.exists()
