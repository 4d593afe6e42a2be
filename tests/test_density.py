"""benchmarks/density.py without the FPGA tools: its designs elaborate, and its figures, ratios,
summary keys and report follow from a fixed set of measured rows."""

import json
import sys
from pathlib import Path

import pytest
from amaranth.hdl import Fragment

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def density():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import density
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return density


TINY = ["--rows", "2", "--cols", "2", "--size", "24", "--tile", "24", "24", "--functions", "--reduced"]


def row(lut4, fmax, dsp=0, ff=100, array=0, lanes=0, whole=None):
    return {"fits": True, "lut4": lut4, "ff": ff, "dsp": dsp, "bram": 2, "fmax_mhz": fmax,
            "seeds": [{"seed": 1, "fmax_mhz": fmax}], "synth_s": 10.0, "pnr_s": [20.0],
            "yosys_lut4": whole or lut4, "array_lut4": array, "lanes_lut4": lanes}


def results(over=None):
    """A 2x2 run: BFP8 LUT-only 1,000 LUT4 at 100 MHz, fp16 3,000 at 50 MHz, bf16 2,000 at 80 MHz."""
    res = {
        ("bfp8", "lut"): row(1000, 100.0, array=300, lanes=200),
        ("bf16", "lut"): row(2000, 80.0, array=1200, lanes=150),
        ("fp16", "lut"): row(3000, 50.0, array=2000, lanes=150),
        ("bfp8", "dsp"): row(600, 120.0, dsp=4),
        ("bf16", "dsp"): row(1500, 60.0, dsp=4),
        ("fp16", "dsp"): row(1600, 60.0, dsp=4),
        ("mult18", "lut"): row(500, 150.0),
    }
    res.update(over or {})
    return res


def test_designs_elaborate_with_booth_multipliers_lut_only(density):
    args = density.parser().parse_args(TINY)
    cfg = density.config(args)
    jobs = density.designs(cfg)
    assert set(jobs) == {(f, m) for f in density.FORMATS for m in density.MODES} | {("mult18", "lut")}
    for (name, mode), factory in jobs.items():
        top, component = factory()
        Fragment.get(component, None)  # elaborates the whole hierarchy
        if name == "bfp8":
            assert top == "gemm_core"
            assert component.cfg.dsp_macs == (0 if mode == "lut" else None)
        elif name != "mult18":
            assert (top, component.fmt) == ("float_core", name)


def test_figures_ratios_and_summary_keys(density):
    cfg = density.config(density.parser().parse_args(TINY))
    fig = density.figures(results(), cfg)
    # MAC/s per LUT4, LUT-only: BFP8 4 x 100 MHz / 1,000 against fp16 4 x 50 MHz / 3,000: 6x.
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] == pytest.approx(6.0)
    assert fig["density_mac_s_per_lut4_vs_bf16_core"] == pytest.approx(2.5)
    assert fig["density_lut4_per_mac_vs_fp16_core"] == pytest.approx(3.0)
    assert fig["density_mac_s_per_lut4_vs_fp16_core_with_dsp"] == pytest.approx((120 / 600) / (60 / 1600))
    assert set(density.SUMMARY) <= set(fig)
    d = fig["designs"]["bfp8-dsp"]
    assert d["lut4_per_mac"] == 150
    assert d["mac_s_per_lut4_eq"] == pytest.approx(4 * 120e6 / (600 + 500 * 4))
    assert fig["ratios"]["mac_s_per_lut4_eq_fp16_dsp"] == pytest.approx(
        (4 * 120e6 / 2600) / (4 * 60e6 / (1600 + 2000)))


def test_report_reads_the_figures(density):
    args = density.parser().parse_args(TINY)
    fig = density.figures(results(), density.config(args))
    text = density.report(fig, args, 60.0)
    assert "| **MAC/s per LUT4, LUT-only** (summary.json) | 2.50x | 6.00x | 8.5x (throughput) |" in text
    assert "meets the floor of 5x" in text
    assert "`dsp_macs=0`" in text and "hw/lut_mult.py" in text
    assert f"Command: `{density.command(args)}`" in text
    # The report's command line is one the parser takes back to the same options.
    again = density.parser().parse_args(density.command(args).split()[2:])
    assert vars(again) == {**vars(args), "write": True}


def test_a_core_that_does_not_fit_leaves_the_ratio_null(density):
    args = density.parser().parse_args(TINY)
    over = {("fp16", "lut"): {**row(0, 0.0, array=9000, lanes=300, whole=90000), "fits": False,
                              "needs": {"TRELLIS_COMB": {"used": 90000, "available": 83640}},
                              "seeds": [], "pnr_s": []}}
    fig = density.figures(results(over), density.config(args))
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] is None
    assert fig["density_mac_s_per_lut4_vs_bf16_core"] == pytest.approx(2.5)
    text = density.report(fig, args, 60.0)
    assert "**does not fit**: TRELLIS_COMB 90,000/83,640" in text
    assert "`density_mac_s_per_lut4_vs_fp16_core` is null" in text


def test_fpga_report_takes_the_summary_from_the_whole_cores(density, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fpga_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cfg = density.config(density.parser().parse_args(TINY))
    fig = density.figures(results(), cfg)
    seen = {}

    def run(args):
        seen.update(vars(args))
        return fig

    monkeypatch.setattr(density, "run", run)
    args = fpga_report.argparse.Namespace(write=True, reuse=True, density_jobs=1)
    got = fpga_report.density_summary(args)
    assert got["density_mac_s_per_lut4_vs_fp16_core"] == pytest.approx(6.0)
    assert (got["density_rows"], got["density_cols"]) == (2, 2)
    assert set(got) <= set(fpga_report.SUMMARY_KEYS)
    assert seen["write"] and seen["reuse"] and seen["jobs"] == 1


def test_a_flattened_synthesis_is_reported_without_breakdown(density):
    args = density.parser().parse_args(TINY)
    over = {("bf16", "lut"): {**row(2000, 80.0), "kept": False, "array_lut4": None, "lanes_lut4": None}}
    fig = density.figures(results(over), density.config(args))
    assert fig["density_mac_s_per_lut4_vs_bf16_core"] == pytest.approx(2.5)
    text = density.report(fig, args, 60.0)
    assert "ABC9 step failed on the kept modules: bf16 `FloatCore` (LUT-only)" in text
    assert "bf16 not broken down (synthesized flattened)" in text


def test_fpga_report_keeps_each_seeds_build_record(tmp_path, monkeypatch):
    """A board built on several placement seeds: each seed's nextpnr report, its log (gzipped)
    and its bitstream's sha256 are kept under docs/reports/<board>/seed<N>/."""
    import gzip
    import hashlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fpga_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from hbfp.hw import boards

    monkeypatch.setattr(fpga_report, "REPORTS", tmp_path / "reports")
    board = boards.BOARDS["ulx3s"]
    runs = []
    for seed in (1, 2):
        folder = tmp_path / f"seed{seed}" / "ulx3s"
        folder.mkdir(parents=True)
        (folder / "hbfp_ulx3s.bit").write_bytes(bytes([seed]) * 10)
        (folder / "hbfp_ulx3s.report.json").write_text(json.dumps({"seed": seed}))
        (folder / "hbfp_ulx3s.tim").write_text(f"Info: Max frequency for clock: {70 + seed} MHz\n")
        runs.append((seed, {"fmax_mhz": 70.0 + seed, "timing_met": False}, None, folder))
    assert fpga_report.keep_builds(board, runs[:1]) == ""  # one seed: nothing kept
    said = fpga_report.keep_builds(board, runs)
    for seed in (1, 2):
        kept = tmp_path / "reports" / "ulx3s" / f"seed{seed}"
        digest = hashlib.sha256(bytes([seed]) * 10).hexdigest()
        assert (kept / "bitstream.sha256").read_text() == f"{digest}  hbfp_ulx3s.bit\n"
        assert json.loads((kept / "nextpnr.report.json").read_text()) == {"seed": seed}
        assert gzip.decompress((kept / "nextpnr.log.gz").read_bytes()).decode().endswith(f"{70 + seed} MHz\n")
        assert f"seed {seed} {digest[:16]}" in said


def test_fpga_report_keeps_a_left_out_boards_seed_figures():
    """--keep-others: a board this run leaves out keeps its summary figures, the seeds' figures
    of an earlier run on several seeds included (a run of another board once dropped them)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fpga_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    before = {"board_colorlight_fmax_mhz": 85.4, "board_colorlight_lut4": 16147, "board_colorlight_bitstream": True,
              "board_colorlight_seeds_timing_met": 3, "board_colorlight_fmax_seeds_mhz": [85.4, 81.2, 86.6],
              "board_ecpix5_fmax_mhz": 79.6}
    kept = fpga_report.kept_summary(before, "colorlight")
    assert kept["board_colorlight_seeds_timing_met"] == 3 and kept["board_colorlight_fmax_seeds_mhz"] == [85.4, 81.2, 86.6]
    assert kept["board_colorlight_fmax_mhz"] == 85.4 and kept["board_colorlight_bitstream"] is True
    assert not any(k.startswith("board_ecpix5_") for k in kept)
    assert "board_ecpix5_seeds_timing_met" not in fpga_report.kept_summary(before, "ecpix5")
