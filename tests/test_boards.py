"""Board builds (``hbfp.hw.boards``, ``hbfp build``): the Quartus projects of the Intel boards
are complete (every top-level port has a pin or is a virtual pin, sources present, clock
constrained, a compile script), and the open-flow projects carry the board's pins and clock.
Small configurations keep the elaboration short; the full builds run in ``make fpga-report``."""

import json
import math
import re

import pytest

from hbfp.hw import boards, openflow
from hbfp.hw.params import CoreConfig

pytestmark = pytest.mark.xdist_group("boards")

SMALL = dict(rows=2, cols=2, size=24, functions=("relu",))


def top_ports(verilog: str, module: str) -> dict[str, int]:
    """Port name -> width of ``module`` in Amaranth's Verilog output."""
    body = verilog[verilog.index(f"module {module}("):]
    body = body[: body.index("endmodule")]
    ports = {}
    for direction, width, name in re.findall(r"^\s*(input|output|inout)\s+(?:wire\s+|reg\s+)?(\[\d+:0\]\s+)?(\S+);",
                                             body, re.M):
        ports[name.lstrip("\\")] = int(width.strip()[1:].split(":")[0]) + 1 if width else 1
    return ports


def qsf_assignments(qsf: str):
    locations = dict(re.findall(r"set_location_assignment -to \"?([^\s\"]+)\"? PIN_(\S+)", qsf))
    virtual = set(re.findall(r"set_instance_assignment -to \"?([^\s\"]+)\"? -name VIRTUAL_PIN", qsf))
    return {k.replace("\\[", "["): v for k, v in locations.items()}, {v.replace("\\[", "[") for v in virtual}


def io_standards(qsf: str) -> dict[str, str]:
    return {port.replace("\\[", "["): std for port, std in
            re.findall(r"set_instance_assignment -to \"?([^\s\"]+)\"? -name IO_STANDARD \"?([^\"\n]+)\"?", qsf)}


#: Quartus I/O standards of a differential pair (a pin and its complement).
DIFFERENTIAL = re.compile(r"LVDS|DIFFERENTIAL|PCML|LVPECL|HCSL|RSDS")


def verilog_modules(verilog: str) -> dict[str, str]:
    """Module name (without Verilog's escape) -> its text, of Amaranth's Verilog output."""
    parts = re.split(r"^module ", verilog, flags=re.M)[1:]
    return {part.split("(", 1)[0].strip().lstrip("\\"): part[: part.index("endmodule")] for part in parts}


def products(module: str) -> list[list[int]]:
    """The multiplications of a module whose operands are both signals (Quartus takes each to a
    DSP block; a constant factor is shifts and adds), as their operands' widths."""
    widths = {name: int(msb) + 1 for msb, name in re.findall(r"^\s*(?:reg|wire|input|output)\s+(?:signed\s+)?"
                                                          r"\[(\d+):0\]\s+(\S+?)\s*[;=]", module, re.M)}
    found = []
    for rhs in re.findall(r"^\s*assign\s+\S+\s*=\s*([^;]*\S\s\*\s[^;]*);", module, re.M):
        operands = [re.sub(r"^\$signed\((.*)\)$", r"\1", o.strip()) for o in rhs.split(" * ")]
        if not any(re.fullmatch(r"\d+'s?[bdh][0-9a-fA-F_]+", o) for o in operands):
            found.append([widths.get(o, 0) for o in operands])
    return found


@pytest.fixture(scope="module")
def stratix5_project(tmp_path_factory):
    """The Stratix board's project in its default configuration (32x32; two minutes to write)."""
    return boards.build("stratix5", tmp_path_factory.mktemp("stratix5"), log=lambda s: None)


@pytest.mark.parametrize("name, clock_ns, pins", [
    ("de10_nano", 20.0, {"V11", "AG13", "AF13"}),  # clk50, UART rx, tx
    ("stratix5", 10.0, {"AH22", "AJ22", "A7"}),  # clk100 (an LVDS pair), rst_n
])
def test_quartus_project_is_complete(tmp_path, request, name, clock_ns, pins):
    if name == "stratix5":  # the board's own configuration, shared with the DSP blocks' test
        result = request.getfixturevalue("stratix5_project")
    else:
        result = boards.build(name, tmp_path, log=lambda s: None, **SMALL)
    d, project = result.directory, result.name
    qsf = (d / f"{project}.qsf").read_text()
    sdc = (d / f"{project}.sdc").read_text()
    script = (d / f"build_{project}.sh").read_text()
    verilog = (d / f"{project}.v").read_text()

    # Device, top, every source file named by the project is there.
    device = {"de10_nano": "5CSEBA6U23I7", "stratix5": "5SGXEA7K2F40C2"}[name]
    assert f"set_global_assignment -name DEVICE {device}" in qsf
    assert f"set_global_assignment -name TOP_LEVEL_ENTITY {project}" in qsf
    sources = re.findall(r"-name VERILOG_FILE \"?([^\s\"]+)\"?", qsf)
    assert f"{project}.v" in sources
    for src in sources:
        assert (d / src).is_file(), src
    # Every bit of every top-level port has a location or is a virtual pin.
    locations, virtual = qsf_assignments(qsf)
    assigned = set(locations) | virtual
    for port, width in top_ports(verilog, project).items():
        for i in range(width):
            assert port in assigned or f"{port}[{i}]" in assigned, f"{port}[{i}] has neither a pin nor VIRTUAL_PIN"
    assert pins <= set(locations.values())
    assert '""' not in qsf  # values quoted once (Tcl)
    assert not set(locations) & virtual
    if name == "stratix5":  # the 128-bit Avalon-ST link: virtual pins only
        data = [v for v in virtual if v.startswith("avalon_st_0__sink_data__io[")]
        assert len(data) == 8 * boards.StratixVGXPlatform.STREAM_BYTES
    else:
        assert not virtual
    # The clock is constrained at the board's frequency, with the clock's uncertainty (jitter)
    # in TimeQuest's analysis; the script runs the whole Quartus flow.
    assert re.search(rf"create_clock -name \S+ -period {clock_ns}\b", sdc)
    assert re.search(r"^\s*derive_clock_uncertainty\s*$", sdc, re.M)
    for tool in ("quartus_map", "quartus_fit", "quartus_asm", "quartus_sta"):
        assert tool in script
    assert (d / "config.json").is_file()
    check_io_standards(qsf, verilog)
    assert clock_port(sdc) in locations


def clock_port(sdc: str) -> str:
    return re.search(r"create_clock .*\[get_ports \"?([^\s\"\]]+)", sdc).group(1)


def check_io_standards(qsf: str, verilog: str) -> None:
    """A differential standard only on the two pins of a pair, each with its location, through a
    differential input buffer; the single-ended ports have single-ended standards."""
    locations, _ = qsf_assignments(qsf)
    standards = io_standards(qsf)
    for port, std in standards.items():
        if DIFFERENTIAL.search(std):
            pair = re.fullmatch(r"(.*)__([pn])", port)
            assert pair, f"{port}: the differential {std} on a single-ended port"
            base, side = pair.groups()
            other = f"{base}__{'n' if side == 'p' else 'p'}"
            assert standards.get(other) == std and port in locations and other in locations, port
            assert re.search(rf"\.datain\({base}__p\),\s*\.datain_b\({base}__n\)", verilog), port
        else:
            assert not port.endswith(("__p", "__n")), f"{port}: half of a pair with the single-ended {std}"


def test_stratix5_clock_is_the_kits_lvds_pair(stratix5_project):
    """The kit's 100 MHz clock is an LVDS pair (CLKINBOT_P0/N0: AH22 and its complement AJ22)
    into a differential buffer, constrained on its p pin, with the clock's uncertainty."""
    d, project = stratix5_project.directory, stratix5_project.name
    qsf, sdc = (d / f"{project}.qsf").read_text(), (d / f"{project}.sdc").read_text()
    locations, _ = qsf_assignments(qsf)
    assert (locations["clk100_0__p"], locations["clk100_0__n"]) == ("AH22", "AJ22")
    assert io_standards(qsf)["clk100_0__p"] == "LVDS"
    check_io_standards(qsf, (d / f"{project}.v").read_text())
    assert clock_port(sdc) == "clk100_0__p" and re.search(r"-period 10.0\b", sdc)
    assert re.search(r"^\s*derive_clock_uncertainty\s*$", sdc, re.M)
    assert "derive_pll_clocks" not in sdc  # no PLL in the design
    assert "altera_pll" not in (d / f"{project}.v").read_text()


def test_stratix5_multipliers_fit_its_dsp_blocks(stratix5_project):
    """The written project's multipliers fit the 5SGXEA7's 256 DSP blocks: the ``dsp_macs`` PEs'
    8x8 products three to a block (9x9 mode), every other multiplication of the design a block
    of its own; the other PEs multiply in LUTs, with no ``*`` of their own."""
    result, platform = stratix5_project, boards.StratixVGXPlatform
    cfg, project = result.cfg, result.name
    modules = verilog_modules((result.directory / f"{project}.v").read_text())
    mac = f"{project}.device.core.mac"
    pe = products(modules[mac])
    assert len(pe) == cfg.dsp_macs < cfg.rows * cfg.cols
    assert all(w <= 9 for widths in pe for w in widths), pe[:3]  # a 9x9 each
    booth = [name for name in modules if name.startswith(f"{mac}.booth_")]
    assert len(booth) == cfg.rows * cfg.cols - cfg.dsp_macs
    assert not any(products(modules[name]) for name in booth)
    others = sum(len(products(text)) for name, text in modules.items() if name != mac)
    assert others >= cfg.out_lanes  # the epilogue's activation units' among them (a lane each)
    blocks = math.ceil(len(pe) / platform.MULTIPLIERS_PER_DSP) + others
    assert blocks <= platform.DSP_BLOCKS, f"{blocks} DSP blocks of {platform.DSP_BLOCKS}"


def test_ecp5_project_has_the_board_pins_and_clock(tmp_path):
    result = boards.build("ulx3s", tmp_path, run=False, log=lambda s: None, **SMALL)
    d, project = result.directory, result.name
    lpf = (d / f"{project}.lpf").read_text()
    for pin in ("G2", "M1", "L4"):  # clk25, UART rx, tx (FTDI)
        assert f'SITE "{pin}"' in lpf
    assert re.search(r"FREQUENCY (PORT|NET) \S+ 25000000", lpf)
    # The design's clock: 75 MHz from the ECP5's PLL (whose output's constraint nextpnr derives
    # from the oscillator's): 25 MHz x 3 / 1, the VCO at 75 MHz x 8.
    il = (d / f"{project}.il").read_text()
    assert "EHXPLLL" in il
    for name, value in (("CLKI_DIV", 1), ("CLKFB_DIV", 3), ("CLKOP_DIV", 8)):
        assert re.search(rf"parameter \\{name} {value}\b", il), name
    # The synchronized reset reaches its flip-flops on a global buffer, not across the fabric.
    assert re.search(r"cell \\DCCA \\reset_buffer", il)
    script = (d / f"build_{project}.sh").read_text()
    assert "--report" in script and "--timing-allow-fail" in script and "ECPPACK" in script
    assert "--placer static" in script
    config = json.loads((d / "config.json").read_text())
    assert config["baud"] == 1000000 and config["clock_hz"] == boards.BOARDS["ulx3s"].pll_hz == 75_000_000
    # Yosys' ABC9 step through the older XAIGER writer (0.70's default mis-synthesized the 16x16 top)
    ys = (d / f"{project}.ys").read_text()
    assert ys.index(openflow.ABC9_XAIGER1) < ys.index("synth_ecp5")


@pytest.mark.parametrize("f_in, f_out, dividers", [(25e6, 75e6, (1, 3, 8)), (25e6, 100e6, (1, 4, 6)),
                                                    (12e6, 48e6, (1, 4, 12))])
def test_ecp5_pll_dividers_make_the_clock_exactly(f_in, f_out, dividers):
    clki, clkfb, clkop = boards.ecp5_pll_dividers(int(f_in), int(f_out))
    assert (clki, clkfb, clkop) == dividers
    assert f_in * clkfb / clki == f_out and 400e6 <= f_out * clkop <= 800e6


def test_ecp5_pll_refuses_what_it_cannot_make():
    with pytest.raises(ValueError, match="3.125-400 MHz"):
        boards.ecp5_pll_dividers(25_000_000, 500_000_000)
    with pytest.raises(ValueError, match="no ECP5 PLL setting makes exactly"):
        boards.ecp5_pll_dividers(25_000_000, 77_777_777)


def test_board_options_are_checked():
    with pytest.raises(ValueError, match="unknown board"):
        boards.board_config("nosuchboard")
    with pytest.raises(ValueError, match="no UART"):
        boards.board_config("stratix5", baud=115200)
    with pytest.raises(ValueError, match="unknown build option"):
        boards.board_config("ulx3s", colour="red")
    board, cfg, kw = boards.board_config("ulx3s", rows=4, cols=4, baud=3_000_000)
    assert cfg == CoreConfig(rows=4, cols=4, size=96, functions=("relu", "gelu")) and kw["baud"] == 3_000_000
    with pytest.raises(ValueError, match="baud needs at least"):
        boards.board_config("ulx3s", baud=25_000_000)  # 75 MHz: 3 clocks a bit, fewer than 4


def test_yowasp_tools_are_found_or_named():
    try:
        env = boards.yowasp_env("ecp5")
    except RuntimeError as e:
        assert "pip install" in str(e)
    else:
        assert set(env) == {"YOSYS", "NEXTPNR_ECP5", "ECPPACK"}


def test_cli_build_lists_boards_and_refuses_bad_options(capsys):
    from hbfp import cli

    assert cli.main(["build", "--list"]) == 0
    out = capsys.readouterr().out
    for name in boards.BOARDS:
        assert name in out
    assert cli.main(["build", "--board", "nosuchboard"]) == 2
    assert "unknown board 'nosuchboard'" in capsys.readouterr().err
    assert cli.main(["build", "--board", "stratix5", "--baud", "9600"]) == 2
    assert "no UART" in capsys.readouterr().err


def test_icebreaker_is_a_reduced_device(tmp_path):
    """The UP5K holds only the reduced 1x1 device: the board's default omits every optional
    unit, the project has the board's pins and synthesizes with the UP5K's DSPs."""
    result = boards.build("icebreaker", tmp_path, run=False, log=lambda s: None)
    core = json.loads((result.directory / "config.json").read_text())["core"]
    assert (core["rows"], core["cols"], core["size"], core["functions"]) == (1, 1, 24, [])
    assert not (core["value_quantizer"] or core["bfp_output"] or core["stochastic"])
    pcf = (result.directory / f"{result.name}.pcf").read_text()
    for pin in ("35", "6", "9"):  # clk12, UART rx, tx (FTDI)
        assert re.search(rf"set_io \S+ {pin}\b", pcf), pin
    script = (result.directory / f"build_{result.name}.sh").read_text()
    assert "NEXTPNR_ICE40" in script and "ICEPACK" in script and "--report" in script
    # ABC's classic LUT mapper in place of synth_ice40's ABC9 step (which exhausts YoWASP's stack)
    ys = (result.directory / f"{result.name}.ys").read_text()
    steps = [f"synth_ice40 -dsp -run begin:map_luts -top {result.name}", "abc -dress -lut 4",
             f"synth_ice40 -dsp -top {result.name} -run map_cells:", f"write_json {result.name}.json"]
    assert [ys.index(step) for step in steps] == sorted(ys.index(step) for step in steps)
    assert "-dff" not in ys and "abc9" not in ys


def test_ice40_native_abc_maps_to_ice40_cells(tmp_path):
    """The iCE40 flow's script runs in YoWASP's Yosys without ABC9: a counter on the iCEBreaker
    comes out as LUTs, carries and flip-flops (and its I/O), nothing left unmapped."""
    import subprocess

    from amaranth import Elaboratable, Module, Signal
    from amaranth.lib import io

    try:
        env = boards.yowasp_env("ice40")
    except RuntimeError as e:
        pytest.skip(str(e))

    class Counter(Elaboratable):
        def elaborate(self, platform):
            m = Module()
            count = Signal(20)
            m.d.sync += count.eq(count + 1)
            m.submodules.led = led = io.Buffer("o", platform.request("led", 0, dir="-"))
            m.d.comb += led.o.eq(count[-1])
            return m

    platform = boards.BOARDS["icebreaker"].platform()
    plan = platform.build(Counter(), name="counter", do_build=False, **openflow.ice40_native_abc("counter"))
    plan.extract(tmp_path)
    subprocess.run([env["YOSYS"], "-q", "-l", "counter.rpt", "counter.ys"], cwd=tmp_path, check=True,
                   capture_output=True)
    log = (tmp_path / "counter.rpt").read_text()
    assert "Executing ABC pass" in log and "ABC9" not in log
    netlist = json.loads((tmp_path / "counter.json").read_text())["modules"]["counter"]
    kinds = {cell["type"] for cell in netlist["cells"].values()}
    assert {"SB_LUT4", "SB_CARRY"} <= kinds and any(kind.startswith("SB_DFF") for kind in kinds), kinds
    assert kinds <= {"SB_LUT4", "SB_CARRY", "SB_DFF", "SB_DFFE", "SB_DFFSR", "SB_DFFESR", "SB_DFFSS", "SB_DFFESS",
                     "SB_IO", "SB_GB_IO", "$scopeinfo"}, kinds


def test_cli_build_units(tmp_path, capsys):
    """``--units`` lists the optional units to build (none when given alone)."""
    from hbfp import cli

    assert cli.main(["build", "--board", "ulx3s", "--rows", "2", "--cols", "2", "--size", "24", "--no-run",
                     "-o", str(tmp_path), "--units", "value_quantizer"]) == 0
    core = json.loads((tmp_path / "ulx3s" / "config.json").read_text())["core"]
    assert (core["value_quantizer"], core["bfp_output"], core["stochastic"]) == (True, False, False)
    assert cli.main(["build", "--board", "ulx3s", "--no-run", "-o", str(tmp_path), "--units", "stochastic"]) == 2
    assert "stochastic rounding needs a quantizer" in capsys.readouterr().err
    assert cli.main(["build", "--list"]) == 0
    assert "without value_quantizer, bfp_output, stochastic" in capsys.readouterr().out


# ---- the Ethernet boards ------------------------------------------------------------------------


@pytest.mark.parametrize("name, pins, osc", [("ecpix5", ("E11", "A12", "C9", "A11"), 100_000_000),
                                             ("colorlight_5a75b", ("M1", "M2", "M3", "N6"), 25_000_000)])
def test_ethernet_board_project(tmp_path, name, pins, osc):
    """The RGMII pins (rx_clk, tx_clk, tx and rx control), the PLL making the link's 125 MHz
    on CLKOP and the core's clock on CLKOS of one VCO, the DDR I/O, and the address in the
    gateware (172.20.30.51:7001 from the options)."""
    result = boards.build(name, tmp_path, run=False, log=lambda s: None, rows=2, cols=2, size=24,
                          ip=boards.parse_ip("172.20.30.51"), port=7001)
    d, project = result.directory, result.name
    lpf = (d / f"{project}.lpf").read_text()
    for pin in pins:
        assert f'SITE "{pin}"' in lpf, pin
    il = (d / f"{project}.il").read_text()
    board = boards.BOARDS[name]
    clki, clkfb, _ = boards.ecp5_pll_dividers(osc, boards.LINK_HZ)
    op = int(re.search(r"parameter \\CLKOP_DIV (\d+)", il).group(1))
    os_ = int(re.search(r"parameter \\CLKOS_DIV (\d+)", il).group(1))
    assert (int(re.search(r"parameter \\CLKI_DIV (\d+)", il).group(1)),
            int(re.search(r"parameter \\CLKFB_DIV (\d+)", il).group(1))) == (clki, clkfb)
    assert boards.LINK_HZ * op == board.pll_hz * os_ and 400e6 <= boards.LINK_HZ * op <= 800e6
    assert "IDDRX1F" in il and "ODDRX1F" in il
    # the RGMII delay the FPGA adds (the PHY adds the other): 80 taps of 25 ps on the received
    # data and control (5 lines) on the Colorlight, on the forwarded transmit clock on the ECPIX-5
    delays = re.findall(r"cell \\DELAYG \S+\n((?:    .*\n)*?)  end", il)
    assert len(delays) == {"colorlight_5a75b": 5, "ecpix5": 1}[name]
    assert all("parameter \\DEL_VALUE 80\n" in cell for cell in delays), delays
    assert 'FREQUENCY PORT "eth_rgmii_0__rx_clk__io" 125000000.0 HZ;' in lpf  # the PHY's receive clock
    config = json.loads((d / "config.json").read_text())
    assert config["stream_bytes"] == {"colorlight_5a75b": 1, "ecpix5": 2}[name]
    assert f"24'{0xAC141E:024b}" in il  # the address's first three bytes, as the receiver compares them
    assert config["link"] == "eth" and config["ip"] == 0xAC141E33 and config["port"] == 7001
    assert config["clock_hz"] == board.pll_hz


def test_ethernet_board_options():
    assert boards.parse_ip("192.168.1.50") == 0xC0A80132
    for bad in ("192.168.1", "1.2.3.256", "a.b.c.d"):
        with pytest.raises(ValueError, match="IPv4 address"):
            boards.parse_ip(bad)
    with pytest.raises(ValueError, match="no network link"):
        boards.board_config("ulx3s", ip=1)
    with pytest.raises(ValueError, match="no UART"):
        boards.board_config("ecpix5", baud=115200)
    board, cfg, kw = boards.board_config("ecpix5")
    assert (cfg.rows, cfg.cols, kw["ip"], kw["port"], board.link) == (16, 16, 0xC0A80132, 7000, "eth")


def test_nextpnr_report_needs_every_clock_met(tmp_path):
    """An Ethernet board has the core's clock and the link's: Fmax is the core's (the board's
    clock), and timing is met only when every clock reaches what it was constrained to."""
    def report(link_mhz):
        path = tmp_path / f"r{link_mhz}.json"
        path.write_text(json.dumps({
            "utilization": {"TRELLIS_COMB": {"used": 10, "available": 20}},
            "fmax": {"$glbnet$clk": {"achieved": 61.0, "constraint": 50},
                     "$glbnet$eth_clk": {"achieved": link_mhz, "constraint": 125}}}))
        return boards.parse_nextpnr_report(path, 50_000_000)

    slow, fast = report(92.7), report(126.0)
    assert slow["fmax_mhz"] == fast["fmax_mhz"] == 61.0
    assert not slow["timing_met"] and fast["timing_met"]
    assert fast["clocks"]["$glbnet$eth_clk"] == (126.0, 125)
