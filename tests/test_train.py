"""The training runs, short: HBFP8 on emu tracks FP32, reports are written, the example runs."""

import runpy
import sys
from pathlib import Path

import numpy as np

from hbfp import host
from hbfp import train as tr

ROOT = Path(__file__).resolve().parents[1]


def test_hbfp8_training_tracks_fp32(tmp_path):
    dev = host.open("emu")
    fp32 = tr.train("mlp", "fp32", epochs=2, max_batches=8, progress=False)
    hbfp8 = tr.train("mlp", "hbfp8", device=dev, device_name="emu", epochs=2, max_batches=8, progress=False)
    assert len(hbfp8.batch_losses) == 16
    # Different arithmetic, same run: close losses, not identical ones.
    assert hbfp8.batch_losses != fp32.batch_losses
    assert np.allclose(hbfp8.batch_losses, fp32.batch_losses, rtol=0.05)
    assert hbfp8.batch_losses[-1] < hbfp8.batch_losses[0]
    # Reproducible: the same run twice gives the same losses bit for bit.
    again = tr.train("mlp", "hbfp8", device=dev, device_name="emu", epochs=2, max_batches=8, progress=False)
    assert again.batch_losses == hbfp8.batch_losses
    table = tr.write_report([fp32, hbfp8], tmp_path, ["note"])
    assert "| mlp | sgd | hbfp8 (default) | hbfp16 | emu | 2 |" in table and "| mlp | sgd | fp32 | fp32 | CPU | 2 |" in table
    # fp32 master weights: a close run, not the same one (the weights differ in their low bits)
    wide32 = tr.train("mlp", "hbfp8", device=dev, epochs=1, max_batches=3, progress=False, weight_storage="fp32")
    assert wide32.weight_storage == "fp32" and hbfp8.weight_storage == "hbfp16"
    assert wide32.batch_losses != hbfp8.batch_losses[:3]
    assert np.allclose(wide32.batch_losses, hbfp8.batch_losses[:3], rtol=0.01)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "results.md").exists() and (tmp_path / "runs.json").exists()


def test_cnn_forward_backward_on_the_device():
    dev = host.open("emu")
    run = tr.train("cnn", "hbfp8", device=dev, device_name="emu", epochs=1, max_batches=2, progress=False)
    assert len(run.batch_losses) == 2 and 0 <= run.final_accuracy <= 1


def test_example_script_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_digits.py", "emu"])
    runpy.run_path(str(ROOT / "examples" / "train_digits.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "epoch 5:" in out and "test accuracy" in out


def test_language_models_train_with_adamw_all_products_on_the_device(tmp_path):
    import pytest
    import torch

    import hbfp.torch as ht

    runs = []
    for kind in tr.LANGUAGE_MODELS:
        fp32 = tr.train(kind, "fp32", epochs=1, max_batches=4, progress=False, optimizer="adamw")
        ht.reset_report()
        hbfp8 = tr.train(kind, "hbfp8", device=host.open("emu"), device_name="emu", epochs=1, max_batches=4,
                         progress=False, optimizer="adamw")
        report = ht.report()
        if kind == "transformer":  # under offload: attention's products counted there, none on the host
            assert sum(c.device_macs for c in report.values()) > 0
            assert sum(c.host_macs for c in report.values()) == 0
        assert hbfp8.recipe == "default" and hbfp8.optimizer == "adamw" and np.isfinite(hbfp8.val_loss)
        assert len(hbfp8.val_losses) == 1 and hbfp8.batch_losses != fp32.batch_losses
        assert np.allclose(hbfp8.batch_losses, fp32.batch_losses, rtol=0.05)
        assert abs(hbfp8.val_loss - fp32.val_loss) / fp32.val_loss < 0.05
        runs += [fp32, hbfp8]
    table = tr.write_report(runs, tmp_path)
    assert "| transformer | adamw | hbfp8 (default) | hbfp16 | emu | 1 |" in table and "val loss" in table
    train, val, chars = tr.load_text_split()
    assert len(train) > 400_000 and len(val) > 40_000 and len(chars) > 90
    with pytest.raises(ValueError, match="optimizer"):
        tr.train("mlp", "fp32", epochs=1, progress=False, optimizer="adam")
    with pytest.raises(ValueError, match="model"):
        tr.train("gpt", "fp32", epochs=1, progress=False)
    assert torch.are_deterministic_algorithms_enabled()


def test_cli_refuses_a_recipe_the_device_cannot_run(tmp_path, capsys):
    from hbfp import cli

    out = tmp_path / "run"
    assert cli.main(["train", "--recipe", "mxint8", "--models", "mlp", "--sim-epochs", "0", "-o", str(out)]) == 2
    assert not out.exists()
    assert "runs its forward products in MXINT8" in capsys.readouterr().err


def test_curves_one_colour_per_model_a_style_per_precision_a_marker_per_optimizer():
    """The demo's 17 runs (docs/reports/demo-runs.json): every run a line of its own (colour,
    style, marker, label all told apart), one colour per model, fp32 solid, emu dashed, sim
    dotted, one marker per optimizer; a --model task measured by accuracy gets no empty
    validation-loss panel."""
    runs = tr.load_runs(ROOT / "docs" / "reports" / "demo-runs.json")
    styles = tr.curve_styles(runs)
    assert len({(s["color"], s["linestyle"], s["marker"]) for s in styles}) == len(runs) == 17
    assert len({s["label"] for s in styles}) == len(runs)
    for r, s in zip(runs, styles):
        for q, t in zip(runs, styles):
            assert (s["color"] == t["color"]) == (r.model == q.model)
            assert (s["marker"] == t["marker"]) == (r.optimizer == q.optimizer)
        assert s["linestyle"] == ("-" if r.precision == "fp32" else ":" if r.device == "sim" else "--")
    assert [p[0] for p in tr.curve_panels(runs)] == ["losses", "test_accuracies", "val_losses"]
    own = [tr.Run(**{**r.__dict__, "model": "mine", "val_losses": []}) for r in runs if r.model == "mlp"]
    assert [p[0] for p in tr.curve_panels(own)] == ["losses", "test_accuracies"]
