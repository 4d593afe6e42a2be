"""README's demo table, made from a `make demo` run's runs.json (never typed by hand).

    python benchmarks/readme_table.py --runs build/demo/runs.json   # keep that run, rewrite README
    python benchmarks/readme_table.py                                 # rewrite README from the kept run
    python benchmarks/readme_table.py --check                         # exit 1 if README differs

The kept run is docs/reports/demo-runs.json (tests/test_readme.py checks that README's table is
its table); the table is `hbfp.train.results_table`'s, results.md's. The lines between the
markers `<!-- demo table ... -->` and `<!-- end of demo table -->` are replaced, nothing else.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
KEPT = ROOT / "docs" / "reports" / "demo-runs.json"
BEGIN = "<!-- demo table: benchmarks/readme_table.py from docs/reports/demo-runs.json -->"
END = "<!-- end of demo table -->"


def table(runs_path: Path = KEPT) -> list[str]:
    from hbfp.train import load_runs, results_table

    return results_table(load_runs(runs_path))


def readme_table(text: str) -> list[str]:
    """The lines between the markers in README's ``text``."""
    lines = text.splitlines()
    if BEGIN not in lines or END not in lines:
        raise ValueError(f"README.md lacks the markers {BEGIN!r} and {END!r}")
    return lines[lines.index(BEGIN) + 1: lines.index(END)]


def rewritten(text: str, rows: list[str]) -> str:
    lines = text.splitlines()
    readme_table(text)  # the markers are there
    begin, end = lines.index(BEGIN), lines.index(END)
    return "\n".join(lines[: begin + 1] + rows + lines[end:]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, help="a make demo run's runs.json to keep as docs/reports/demo-runs.json")
    ap.add_argument("--check", action="store_true", help="only compare README's table with the kept run's")
    args = ap.parse_args(argv)
    if args.runs is not None:
        if args.check:
            ap.error("--check compares with the kept run: leave out --runs")
        if not args.runs.is_file():
            ap.error(f"no such file: {args.runs}")
        table(args.runs)  # readable runs before anything is replaced
        shutil.copyfile(args.runs, KEPT)
    rows = table()
    text = README.read_text()
    if args.check:
        if readme_table(text) != rows:
            print("README.md's demo table differs from docs/reports/demo-runs.json's: run benchmarks/readme_table.py",
                  file=sys.stderr)
            return 1
        print("README.md's demo table is docs/reports/demo-runs.json's")
        return 0
    README.write_text(rewritten(text, rows))
    print(f"README.md: demo table of {len(rows) - 2} runs from {KEPT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
