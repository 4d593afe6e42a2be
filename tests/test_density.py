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


TINY = ["--arrays", "2x2", "4x4", "--size", "24", "--tile", "24", "24", "--functions", "--reduced"]
A, B = (2, 2), (4, 4)


def row(lut4, fmax, dsp=0, ff=100, array=0, lanes=0, whole=None, fits=True):
    out = {"fits": fits, "lut4": lut4, "ff": ff, "dsp": dsp, "bram": 2, "synth_s": 10.0, "yosys_lut4": whole or lut4,
           "array_lut4": array, "lanes_lut4": lanes, "abc9_writer": "xaiger2"}
    if fits:
        return {**out, "fmax_mhz": fmax, "seeds": [{"seed": s, "fmax_mhz": fmax + s - 2} for s in (1, 2, 3)],
                "pnr_s": [20.0] * 3}
    return {**out, "seeds": [], "pnr_s": [], "needs": {"TRELLIS_COMB": {"used": lut4, "available": 83640}}}


def results(over=None):
    """2x2 and 4x4 runs. LUT-only: BFP8 1,000 + 100 per PE at 100 MHz; fp16 2,000 + 700 per PE
    at 50 MHz; bf16 2,000 + 500 per PE at 80 MHz. With DSPs: less, 4 and 16 blocks."""
    res = {("mult18", "lut", None): row(500, 150.0)}
    for a, pes in ((A, 4), (B, 16)):
        res |= {
            ("bfp8", "lut", a): row(1000 + 100 * pes, 100.0, array=50 * pes, lanes=200),
            ("bf16", "lut", a): row(2000 + 500 * pes, 80.0, array=400 * pes, lanes=150),
            ("fp16", "lut", a): row(2000 + 700 * pes, 50.0, array=600 * pes, lanes=150),
            ("bfp8", "dsp", a): row(600 + 50 * pes, 120.0, dsp=pes),
            ("bf16", "dsp", a): row(1500 + 300 * pes, 60.0, dsp=pes),
            ("fp16", "dsp", a): row(1600 + 400 * pes, 60.0, dsp=pes),
        }
    res.update(over or {})
    return res


def run_figures(density, over=None, argv=TINY):
    args = density.parser().parse_args(argv)
    return args, density.figures(results(over), density.configs(args))


def test_designs_elaborate_with_booth_multipliers_lut_only(density):
    args = density.parser().parse_args(TINY)
    cfgs = density.configs(args)
    assert set(cfgs) == {A, B}
    jobs = density.designs(cfgs)
    assert set(jobs) == ({(f, m, a) for f in density.FORMATS for m in density.MODES for a in (A, B)}
                         | {("mult18", "lut", None)})
    for (name, mode, a), factory in jobs.items():
        if a == B:
            continue
        top, component = factory()
        Fragment.get(component, None)  # elaborates the whole hierarchy
        if name == "mult18":
            continue
        # LUT-only, every core's PEs multiply with Booth LUT products; with DSPs, all in DSP blocks.
        assert component.cfg.dsp_macs == (0 if mode == "lut" else None)
        assert (component.cfg.rows, component.cfg.cols) == a
        assert top == ("gemm_core" if name == "bfp8" else "float_core")
        if name != "bfp8":
            assert component.fmt == name


def test_figures_ratios_fit_and_summary_keys(density):
    _, fig = run_figures(density)
    # The largest array, LUT-only (both fit): BFP8 16 x 100 MHz / 2,600 against fp16 16 x 50 MHz / 13,200.
    assert fig["density_flow"] == "lut" and (fig["density_rows"], fig["density_cols"]) == (4, 4)
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] == pytest.approx((100 / 2600) / (50 / 13200))
    assert fig["density_mac_s_per_lut4_vs_bf16_core"] == pytest.approx((100 / 2600) / (80 / 10000))
    assert fig["density_lut4_per_mac_vs_fp16_core"] == pytest.approx(13200 / 2600)
    assert fig["density_mac_s_per_lut4_vs_fp16_core_with_dsp"] == pytest.approx((120 / 1400) / (60 / 8000))
    assert (fig["density_bfp8_core_lut4"], fig["density_fp16_core_lut4"]) == (2600, 13200)
    assert (fig["density_bfp8_core_fmax_mhz"], fig["density_fp16_core_fmax_mhz"]) == (100.0, 50.0)
    # The fit: fixed + per PE, from the two arrays.
    assert fig["density_per_pe_lut4_bfp8"] == pytest.approx(100)
    assert fig["density_per_pe_lut4_fp16"] == pytest.approx(700)
    assert fig["density_fixed_lut4_fp16"] == pytest.approx(2000)
    assert fig["density_per_pe_lut4_vs_fp16"] == pytest.approx(7.0) == fig["density_per_pe_lut4_vs_fp16_lut"]
    assert fig["density_per_pe_lut4_vs_bf16"] == pytest.approx(5.0)
    # The MAC array module's own fit (Yosys): 600 per fp16 PE against 50 per BFP8 PE.
    assert fig["array_fits"]["fp16-lut"]["per_pe_lut4"] == pytest.approx(600)
    assert fig["array_fit_ratios"]["per_pe_lut4_fp16_lut"] == pytest.approx(12.0)
    assert set(density.SUMMARY) <= set(fig)
    d = fig["designs"]["bfp8-dsp-4x4"]
    assert d["lut4_per_mac"] == pytest.approx(1400 / 16)
    assert d["mac_s_per_lut4_eq"] == pytest.approx(16 * 120e6 / (1400 + 500 * 16))
    assert fig["ratios"]["2x2"]["mac_s_per_lut4_fp16_lut"] == pytest.approx((100 / 1400) / (50 / 4800))


def test_fit_is_least_squares_over_more_sizes(density):
    got = density.fit([(4, 1400), (16, 2600), (64, 7400)])
    assert got["per_pe_lut4"] == pytest.approx(100) and got["fixed_lut4"] == pytest.approx(1000)
    assert density.fit([(16, 2600)]) is None


def test_report_reads_the_figures(density):
    args, fig = run_figures(density)
    text = density.report(fig, args, 60.0)
    assert "## 2x2 arrays" in text and "## 4x4 arrays" in text
    assert "| MAC/s per LUT4, LUT-only | 4.81x | 10.15x |" in text
    assert "**10.15x** the fp16 core's" in text and "meets the floor of 6x" in text
    assert "**7.00x** (5.00x for bf16)" in text
    assert "| fp16 `FloatCore` | LUT-only | 2,000 | 700.0 | 7.00x | 600.0 | 12.00x |" in text
    assert "100.0 MHz (99.0-101.0)" in text
    assert "`dsp_macs=0`" in text and "hw/lut_mult.py" in text
    assert f"Command: `{density.command(args)}`" in text
    # The report's command line is one the parser takes back to the same options.
    again = density.parser().parse_args(density.command(args).split()[2:])
    assert vars(again) == {**vars(args), "write": True}


def test_a_core_that_does_not_fit_lut_only_compares_with_dsp_blocks(density):
    args, fig = run_figures(density, {("fp16", "lut", B): row(90000, 0.0, fits=False)})
    assert fig["density_flow"] == "dsp"
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] == pytest.approx((120 / 1400) / (60 / 8000))
    # The per-PE figures follow: the fit with DSP blocks (fp16 400 a PE, BFP8 50).
    assert fig["density_per_pe_lut4_fp16"] == pytest.approx(400) and fig["density_per_pe_lut4_bfp8"] == pytest.approx(50)
    assert fig["density_per_pe_lut4_vs_fp16"] == pytest.approx(8.0)
    # LUT-only, its packed count still enters the fit.
    assert fig["fits"]["fp16-lut"]["per_pe_lut4"] == pytest.approx((90000 - 4800) / 12)
    assert fig["density_per_pe_lut4_vs_fp16_lut"] == pytest.approx((90000 - 4800) / 12 / 100)
    text = density.report(fig, args, 60.0)
    assert "**Per PE, with DSP blocks** (one MULT18X18D a PE in every core" in text
    assert "LUT-only (every multiplier in LUTs; `density_per_pe_lut4_vs_fp16_lut`" in text
    assert "90,000 (**does not fit**: TRELLIS_COMB 90,000/83,640)" in text
    assert "LUT-only the fp16 core does not fit LFE5U-85F at 4x4" in text


def test_a_part_of_the_experiment_leaves_the_rest_null(density):
    argv = TINY + ["--formats", "bfp8", "fp16", "--modes", "lut"]
    args = density.parser().parse_args(argv)
    res = {k: v for k, v in results().items() if k[0] in ("bfp8", "fp16") and k[1] == "lut"}
    fig = density.figures(res, density.configs(args))
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] is not None
    assert fig["density_mac_s_per_lut4_vs_bf16_core"] is None
    assert fig["density_mac_s_per_lut4_vs_fp16_core_with_dsp"] is None
    assert fig["density_per_pe_lut4_vs_bf16"] is None and fig["density_per_pe_lut4_vs_fp16"] == pytest.approx(7.0)
    text = density.report(fig, args, 60.0)
    assert "| bf16 `FloatCore` | LUT-only | not measured |" in text
    assert "--formats bfp8 fp16 --modes lut" in density.command(args)


def test_an_incomplete_comparison_says_so(density):
    args, fig = run_figures(density, {("fp16", "lut", B): row(90000, 0.0, fits=False),
                                      ("fp16", "dsp", B): row(90000, 0.0, fits=False)})
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] is None and fig["density_flow"] is None
    assert "`density_mac_s_per_lut4_vs_fp16_core` is null" in density.report(fig, args, 60.0)


def test_fpga_report_takes_the_summary_from_the_whole_cores(density, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fpga_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    _, fig = run_figures(density)
    seen = {}

    def run(args):
        seen.update(vars(args))
        return fig

    monkeypatch.setattr(density, "run", run)
    args = fpga_report.argparse.Namespace(write=True, reuse=True, density_jobs=1)
    got = fpga_report.density_summary(args)
    assert got["density_per_pe_lut4_vs_fp16"] == pytest.approx(7.0)
    assert (got["density_rows"], got["density_cols"]) == (4, 4)
    assert set(got) <= set(fpga_report.SUMMARY_KEYS)
    assert seen["write"] and seen["reuse"] and seen["jobs"] == 1


def test_bad_arrays_are_refused(density, capsys):
    for bad, message in (("8", "an array is ROWSxCOLS"), ("0x4", "sides must be positive"), ("axb", "ROWSxCOLS"),
                         ("8x8:sa", "placer 'sa' is not one of heap, static")):
        with pytest.raises(SystemExit):
            density.parser().parse_args(["--arrays", bad])
        assert message in capsys.readouterr().err


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


def test_an_array_may_name_its_placer(density):
    """``--arrays 4x4 8x8:static``: every core of 8x8 placed by nextpnr's static placer, named
    in the report, the figures and the command line."""
    argv = ["--arrays", "2x2", "4x4:static", "--size", "24", "--tile", "24", "24", "--functions", "--reduced"]
    args = density.parser().parse_args(argv)
    assert density.placers(args) == {A: "heap", B: "static"}
    assert density.parser().parse_args(["--arrays", "4x4:heap"]).arrays == ["4x4"]
    fig = density.figures(results(), density.configs(args), density.placers(args))
    assert fig["config"]["placers"] == {"2x2": "heap", "4x4": "static"}
    text = density.report(fig, args, 60.0)
    assert "## 4x4 arrays (nextpnr's static placer)" in text and "## 2x2 arrays\n" in text
    assert "2x2 HeAP (the default), 4x4 static" in text
    assert "--arrays 2x2 4x4:static " in density.command(args)


def test_packed_only_designs_enter_the_fit_without_fmax(density):
    """``--pack-only``: counts after packing, no placement: the per-PE fit and LUT4 per MAC,
    no MAC/s (the whole-core ratio is null)."""
    args = density.parser().parse_args(TINY + ["--pack-only"])
    res = {k: {kk: vv for kk, vv in v.items() if kk != "fmax_mhz"} | {"seeds": [], "pnr_s": []}
           for k, v in results().items()}
    fig = density.figures(res, density.configs(args))
    assert fig["density_per_pe_lut4_vs_fp16"] == pytest.approx(7.0)
    assert fig["density_mac_s_per_lut4_vs_fp16_core"] is None and fig["density_flow"] is None
    assert fig["designs"]["fp16-lut-4x4"]["lut4_per_mac"] == pytest.approx(13200 / 16)
    text = density.report(fig, args, 60.0)
    assert "| fp16 `FloatCore` | LUT-only | 13,200 | 100 | 0 | 2 | not placed | 825.0 | - |" in text
    assert density.command(args).endswith("--seeds 1 2 3 --write") and " --pack-only " in density.command(args)


def test_a_saved_report_marks_the_seeds_not_run(density):
    args = density.parser().parse_args(TINY + ["--saved"])
    over = {("fp16", "dsp", B): {**results()[("fp16", "dsp", B)], "seeds": [], "pnr_s": [], "seeds_not_run": [1, 2, 3]}}
    over[("fp16", "dsp", B)].pop("fmax_mhz")
    fig = density.figures(results(over), density.configs(args))
    text = density.report(fig, args, 1.0)
    assert "**Incomplete:**" in text and "fp16-dsp-4x4" in text.split("**Incomplete:**")[1].split("\n")[0]
    assert "| fp16-dsp-4x4 | -; seeds 1, 2, 3 not run yet |" in text
    assert "--saved" not in density.command(args)


def test_measure_saves_each_step_and_a_saved_run_takes_them(density, tmp_path, monkeypatch):
    """``measure`` with the tools faked: synthesis, packing and each seed are saved as they are
    done; ``--reuse`` runs only what is missing, ``--saved`` runs nothing."""
    calls = []

    def synth(src, top, d, nodsp=False, keep=(), xaiger1=False, log=None):
        calls.append("synth")
        (Path(d) / f"{top}.json").write_text("{}")
        return {"json": Path(d) / f"{top}.json", "cells": {"LUT4": 400, "CCU2C": 50}, "modules": {}, "seconds": 1.0}

    def pnr(json_path, work, device, package, freq, seed=1, *, placer=None, pack_only=False, log=None):
        calls.append("pack" if pack_only else f"seed{seed}")
        util = {"TRELLIS_COMB": (500, 83640), "TRELLIS_FF": (72, 83640)}
        return {"utilization": util, "fmax_min": None if pack_only else 150.0 + seed, "seconds": 2.0}

    monkeypatch.setattr(density, "synth_ecp5", synth)
    monkeypatch.setattr(density, "pnr_ecp5", pnr)
    key, factory = ("mult18", "lut", None), (lambda: ("top", density.Mult18()))
    args = density.parser().parse_args(TINY + ["--seeds", "1", "2", "--out", str(tmp_path)])
    row = density.measure(key, factory, tmp_path, args, lambda s: None)
    assert calls == ["synth", "pack", "seed1", "seed2"]
    assert (row["lut4"], row["ff"], row["yosys_lut4"], row["fmax_mhz"]) == (500, 72, 500, 151.5)
    # --saved with a seed more than was run: nothing runs, the seed is marked.
    calls.clear()
    args = density.parser().parse_args(TINY + ["--seeds", "1", "2", "3", "--saved"])
    row = density.measure(key, factory, tmp_path, args, lambda s: None)
    assert calls == [] and row["seeds_not_run"] == [3] and row["fmax_mhz"] == 151.5
    # --reuse runs just the missing seed.
    args = density.parser().parse_args(TINY + ["--seeds", "1", "2", "3", "--reuse"])
    row = density.measure(key, factory, tmp_path, args, lambda s: None)
    assert calls == ["seed3"] and row["fmax_mhz"] == 152.0 and "seeds_not_run" not in row
    # Nothing saved for another folder: --saved reports it as not measured.
    assert density.measure(key, factory, tmp_path / "other", args_saved(density), lambda s: None) is None


def args_saved(density):
    return density.parser().parse_args(TINY + ["--saved"])
