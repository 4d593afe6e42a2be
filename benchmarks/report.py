"""Shared by the benchmarks that write a report: print it, and with ``--write`` save it."""

from __future__ import annotations

import re
from pathlib import Path

#: Where the reports live.
REPORTS = Path(__file__).resolve().parents[1] / "docs" / "reports"


def publish(text: str, name: str, write: bool) -> None:
    """Print ``text``; with ``write`` also save it as docs/reports/``name``."""
    print(text)
    if write:
        out = REPORTS / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written {out}")


def verilog_logic(verilog_text: str | Path) -> str:
    """Verilog without its source-line attributes (an edit elsewhere in a file moves them): two
    designs with the same logic compare equal, so a saved result can stand for both."""
    if isinstance(verilog_text, Path):
        verilog_text = verilog_text.read_text()
    return re.sub(r'\(\* src = "[^"]*" \*\)', "", verilog_text)


def rtlil_logic(rtlil_text: str | Path) -> str:
    """RTLIL without its source-line attributes: ``verilog_logic`` for RTLIL."""
    if isinstance(rtlil_text, Path):
        rtlil_text = rtlil_text.read_text()
    return re.sub(r'^\s*attribute \\src "[^"]*"\n', "", rtlil_text, flags=re.M)
