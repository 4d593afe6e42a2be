import importlib.util
import pathlib
import re

import pytest

from hbfp import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_golden_demo_prints_errors_and_savings(capsys):
    assert cli.main(["golden-demo", "--m", "30", "--k", "100", "--n", "20"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    for name in ("fp32 (numpy matmul)", "HBFP8 (8-bit, 24x24 tiles)", "MXINT8 (8-bit, 1x32 blocks)"):
        assert name in rows, out
    hbfp8 = rows["HBFP8 (8-bit, 24x24 tiles)"].split()
    rel_error, saved = float(hbfp8[-4]), float(hbfp8[-1].rstrip("%"))
    assert 1e-4 < rel_error < 0.1  # 8-bit mantissas: about 1e-2, far above fp32's 1e-7
    assert 70 < saved < 76  # 8 bits + 1/576 byte per element against 32 bits


def test_cli_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "golden-demo" in capsys.readouterr().out


def test_cli_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        cli.main(["golden-demo", "--m", "0"])


def test_bench_runs_and_prints_ratios(capsys):
    spec = importlib.util.spec_from_file_location("bench_golden", ROOT / "benchmarks" / "bench_golden.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--sizes", "48", "--repeats", "1", "--quantize-shape", "64", "64"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"48\^3\s+[\d.]+ms\s+[\d.]+ms\s+[\d.]+x", out), out
    assert re.search(r"HBFP8 stochastic:\s+[\d.]+ M elements/s", out), out
