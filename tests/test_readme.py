"""README's figures come from runs, and its snippets run: the demo table is the table of the
kept `make demo` run (docs/reports/demo-runs.json, benchmarks/readme_table.py), and every
Python block of README runs as written."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
readme_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_table)


def test_the_readme_demo_table_is_the_kept_runs_table():
    pytest.importorskip("torch")
    rows = readme_table.table()
    assert readme_table.readme_table((ROOT / "README.md").read_text()) == rows
    assert len(rows) > 2 and all(r.startswith("|") and r.endswith("|") for r in rows)


def test_the_table_script_replaces_only_between_its_markers(tmp_path):
    pytest.importorskip("torch")
    text = f"before\n{readme_table.BEGIN}\n| old |\n{readme_table.END}\nafter\n"
    out = readme_table.rewritten(text, ["| a |", "| b |"])
    assert out == f"before\n{readme_table.BEGIN}\n| a |\n| b |\n{readme_table.END}\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        readme_table.readme_table("no markers here")


PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.parametrize("i", range(len(PYTHON_BLOCKS)))
def test_readme_python_blocks_run(i, tmp_path):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", PYTHON_BLOCKS[i]], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, f"README's Python block {i + 1} failed:\n{PYTHON_BLOCKS[i]}\n{r.stderr[-2000:]}"
