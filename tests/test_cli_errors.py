"""Errors before work, one convention (issue 33): every subcommand refuses a bad value of each
of its options at once, before it trains, builds or writes anything, with one line on stderr
(``hbfp COMMAND: message``), exit status 2 and no traceback.

The cases run as subprocesses of the ``hbfp`` entry point, in parallel; the subcommands and
their options are read from the parser, so that a new subcommand or option without a case
here fails ``test_every_option_of_every_command_has_a_case``."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hbfp import cli

ROOT = Path(__file__).resolve().parents[1]
#: The console script of this environment (``python -m hbfp.cli`` where it is not installed).
_SCRIPT = Path(sys.executable).parent / "hbfp"
HBFP = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "hbfp.cli"]
#: Seconds a case may take: the checks come before any work. The limit holds the command's own
#: time (CPU, user and system), which the load of a shared machine does not stretch; the clock
#: on the wall gets a wider one, against a command that waits (for a network, a lock).
LIMIT, WALL_LIMIT = 5.0, 20.0

#: Stand-ins in a case's arguments: a folder that does not exist yet (it must not after the
#: run), a file of the user's in the way (it must be unchanged), a folder name longer than the
#: file system takes, and a folder that cannot be made (/proc takes none, root or not).
OUT, FILE, LONG, UNMAKEABLE = "{out}", "{file}", "{long}", "/proc/hbfp-test-output"
BAD_FOLDERS = [FILE, LONG, "", UNMAKEABLE]

#: command -> option (its ``dest``) -> cases, each the arguments after ``hbfp``. A case holds
#: one bad value; everything else in it is fine.
CASES: dict[str, dict[str, list[list[str]]]] = {
    "golden-demo": {
        "m": [["golden-demo", "--m", "0"]],
        "k": [["golden-demo", "--k", "-1"]],
        "n": [["golden-demo", "--n", "x"]],
        "seed": [["golden-demo", "--seed", "-1"]],
    },
    "verilog": {
        "rows": [["verilog", "--rows", "5", "-o", OUT]],  # 96 is no multiple of 5
        "cols": [["verilog", "--cols", "0", "-o", OUT]],
        "format": [["verilog", "--format", "HBFP9", "-o", OUT]],
        "mantissa_bits": [["verilog", "--mantissa-bits", "0", "-o", OUT]],
        "tile": [["verilog", "--tile", "0", "24", "-o", OUT]],
        "size": [["verilog", "--size", "0", "-o", OUT]],
        "functions": [["verilog", "--functions", "sigmoidish", "-o", OUT]],
        "units": [["verilog", "--units", "teleporter", "-o", OUT]],
        "output": [["verilog", "--only", "normalize", "-o", bad] for bad in BAD_FOLDERS],
        "only": [["verilog", "--only", "bogus", "-o", OUT]],
    },
    "build": {
        "board": [["build", "--board", "nosuch", "--no-run", "-o", OUT]],
        "rows": [["build", "--board", "ulx3s", "--rows", "0", "-o", OUT]],  # the issue's case, with the tools' run
        "cols": [["build", "--board", "icebreaker", "--cols", "5", "--no-run", "-o", OUT]],  # 24 is no multiple of 5
        "format": [["build", "--board", "icebreaker", "--format", "HBFP9", "--no-run", "-o", OUT]],
        "mantissa_bits": [["build", "--board", "icebreaker", "--mantissa-bits", "0", "--no-run", "-o", OUT]],
        "tile": [["build", "--board", "icebreaker", "--tile", "0", "0", "--no-run", "-o", OUT]],
        "size": [["build", "--board", "icebreaker", "--size", "0", "--no-run", "-o", OUT]],
        "functions": [["build", "--board", "icebreaker", "--functions", "sigmoidish", "--no-run", "-o", OUT]],
        "units": [["build", "--board", "icebreaker", "--units", "teleporter", "--no-run", "-o", OUT]],
        "baud": [["build", "--board", "icebreaker", "--baud", "0", "--no-run", "-o", OUT]],
        "fifo_depth": [["build", "--board", "icebreaker", "--fifo-depth", "0", "--no-run", "-o", OUT]],
        "max_payload": [["build", "--board", "icebreaker", "--max-payload", "-5", "--no-run", "-o", OUT]],
        "ip": [["build", "--board", "ecpix5", "--ip", "192.168.1.300", "--no-run", "-o", OUT]],
        "port": [["build", "--board", "ecpix5", "--port", "70000", "--no-run", "-o", OUT]],
        "seed": [["build", "--board", "icebreaker", "--seed", "-1", "--no-run", "-o", OUT]],
        "output": [["build", "--board", "icebreaker", "--no-run", "-o", bad] for bad in BAD_FOLDERS],
    },
    "train": {
        "device": [["train", "--device", "bogus:", "-o", OUT], ["train", "--device", "emu:rows=5", "-o", OUT],
                   ["train", "--device", "", "-o", OUT],
                   ["train", "--nproc", "2", "--device", "tcp:127.0.0.1:{7000+ranks}", "-o", OUT]],
        "models": [["train", "--models", "gpt", "-o", OUT]],
        "model": [["train", "--model", "no_factory_named", "-o", OUT],
                  ["train", "--model", "examples.my_model:build", "--models", "mlp", "-o", OUT]],
        "optimizers": [["train", "--optimizers", "adam", "-o", OUT]],
        "recipe": [["train", "--recipe", "nosuch", "-o", OUT],
                   ["train", "--recipe", "mxint8", "-o", OUT]],  # a format the device does not compute in
        "epochs": [["train", "--epochs", "0", "-o", OUT], ["train", "--epochs", "-1", "-o", OUT]],
        "seed": [["train", "--seed", "-1", "-o", OUT]],
        "weight_storage": [["train", "--weight-storage", "fp8", "-o", OUT]],
        "sim_epochs": [["train", "--sim-epochs", "-1", "-o", OUT]],
        "sim": [["train", "--sim", "bogus:", "-o", OUT]],
        "out": [["train", "-o", bad] for bad in BAD_FOLDERS],
        "nproc": [["train", "--nproc", "0", "-o", OUT]],
        "timeout": [["train", "--timeout", "0", "-o", OUT], ["train", "--timeout", "inf", "-o", OUT]],
        "grad_compression": [["train", "--grad-compression", "zip", "-o", OUT],
                             ["train", "--error-feedback", "-o", OUT]],  # feedback with no compression
        "grad_exchange": [["train", "--grad-compression", "hbfp8", "--grad-exchange", "three", "-o", OUT]],
    },
    "info": {
        "device": [["info", "bogus:"], ["info", "emu:nosuch=1"], ["info", "tcp:127.0.0.1:99999"]],
        "timeout": [["info", "--timeout", "0"], ["info", "--timeout", "nan"]],
    },
    "gemm": {
        "device": [["gemm", "bogus:"], ["gemm", "emu:rows=5"], ["gemm", ""],
                   ["gemm", "emu:format=MXINT8", "--transpose-a"]],  # a product this device's tiles cannot serve
        "m": [["gemm", "emu", "--m", "0"]],
        "n": [["gemm", "emu", "--n", "-3"]],
        "k": [["gemm", "emu", "--k", "1.5"]],
        "out": [["gemm", "emu", "--out", "fp64"]],
        "input": [["gemm", "emu", "--input", "fp64"]],
        "rounding": [["gemm", "emu", "--rounding", "up"]],
        "activation": [["gemm", "emu", "--activation", "softmax"]],
        "seed": [["gemm", "emu", "--seed", "-1"]],
        "timeout": [["gemm", "emu", "--timeout", "-1"]],
    },
    "sim-server": {
        "device": [["sim-server", "--device", "bogus:", "--port", "0"]],
        "host": [["sim-server", "--device", "emu", "--host", "192.0.2.1", "--port", "0"]],  # not this machine's
        "port": [["sim-server", "--device", "emu", "--port", "99999"]],
        "connections": [["sim-server", "--device", "emu", "--port", "0", "--connections", "0"]],
        "idle_timeout": [["sim-server", "--device", "emu", "--port", "0", "--idle-timeout", "0"]],
        "client_timeout": [["sim-server", "--device", "emu", "--port", "0", "--client-timeout", "-1"]],
        "max_queued": [["sim-server", "--device", "emu", "--port", "0", "--max-queued", "0"]],
        "max_clients": [["sim-server", "--device", "emu", "--port", "0", "--max-clients", "0"]],
        "reply_timeout": [["sim-server", "--device", "emu", "--port", "0", "--reply-timeout", "0"]],
        "udp": [["sim-server", "--device", "emu", "--udp", "70000"]],
        "drop": [["sim-server", "--device", "emu", "--udp", "0", "--drop", "1.5"]],
        "corrupt": [["sim-server", "--device", "emu", "--udp", "0", "--corrupt", "-0.1"]],
    },
}


def options_taking_values() -> dict[str, set[str]]:
    """Each subcommand of the parser and the ``dest`` of every option or positional that takes
    a value (not the flags)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {a.dest for a in p._actions if a.nargs != 0 and not isinstance(a, argparse._HelpAction)}
            for name, p in sub.choices.items()}


def test_every_option_of_every_command_has_a_case():
    have = options_taking_values()
    assert set(CASES) == set(have), f"commands without cases: {set(have) - set(CASES)}; stale: {set(CASES) - set(have)}"
    for command, dests in have.items():
        assert set(CASES[command]) == dests, (f"hbfp {command}: options without a case {sorted(dests - set(CASES[command]))}, "
                                              f"cases of no option {sorted(set(CASES[command]) - dests)}")


def _run(args: list[str], place: Path) -> list[str]:
    """Run one case in its own folder ``place`` (its working directory, so that a default output
    folder lands there too); what is wrong with the outcome (nothing: empty)."""
    place.mkdir()
    out, afile = place / "out", place / "file"
    afile.write_text("the user's\n")
    args = [a.replace(OUT, str(out)).replace(FILE, str(afile)).replace(LONG, str(place / ("x" * 300))) for a in args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "ignore"}
    stdout, stderr = place.parent / f"{place.name}.out", place.parent / f"{place.name}.err"
    t0 = time.monotonic()
    with open(stdout, "w") as o, open(stderr, "w") as e:
        p = subprocess.Popen([*HBFP, *args], stdout=o, stderr=e, env=env, cwd=place, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    timer = threading.Timer(WALL_LIMIT, os.killpg, (p.pid, signal.SIGKILL))  # and what it started
    timer.start()
    _, status, usage = os.wait4(p.pid, 0)  # the child's own CPU time beside the clock's
    timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    wall, cpu = time.monotonic() - t0, usage.ru_utime + usage.ru_stime
    printed, err = stdout.read_text(), stderr.read_text().strip()
    if wall >= WALL_LIMIT:
        return [f"still running after {WALL_LIMIT:g} s"]
    wrong = []
    if p.returncode != 2:
        wrong.append(f"exit status {p.returncode}")
    if "Traceback" in err + printed:
        wrong.append("a traceback")
    if len(err.splitlines()) != 1:
        wrong.append(f"{len(err.splitlines())} lines on stderr")
    elif not err.startswith(f"hbfp {args[0]}: "):
        wrong.append("not 'hbfp COMMAND: ...'")
    if cpu > LIMIT:
        wrong.append(f"{cpu:.1f} s of CPU ({wall:.1f} s on the clock)")
    left = sorted(f.name for f in place.iterdir() if f.name != "file")
    if left or afile.read_text() != "the user's\n":
        wrong.append(f"wrote {left or 'into the file in the way'}")
    return [f"{'; '.join(wrong)}: {err[:300]!r}"] if wrong else []


def test_bad_values_are_refused_at_once_in_one_line(tmp_path):
    cases = [args for options in CASES.values() for variants in options.values() for args in variants]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda i: _run(cases[i], tmp_path / f"case{i}"), range(len(cases))))
    failed = [f"hbfp {' '.join(args)}: {wrong[0]}" for args, wrong in zip(cases, results) if wrong]
    assert not failed, "\n".join(failed)


def test_messages_name_the_problem(tmp_path, capsys):
    """The issue's cases, in process: what the line says."""
    assert cli.main(["info", "bogus:"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'bogus'" in err and "emu" in err and "sim" in err and "bogus::" not in err and "\n" not in err, err
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--epochs", "0", "-o", str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "hbfp train: --epochs must be at least 1, got 0"
    with pytest.raises(SystemExit):
        cli.main(["sim-server", "--port", "99999"])
    assert capsys.readouterr().err.strip() == "hbfp sim-server: --port must be 0 .. 65535, got 99999"
    assert cli.main(["build", "--board", "nosuch", "-o", str(tmp_path / "out")]) == 2
    assert "unknown board 'nosuch'; boards: ulx3s" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bad_run_keeps_the_previous_report(tmp_path, capsys):
    """A refused ``hbfp train`` leaves an earlier run's report as it was."""
    from hbfp import train as tr

    out = tmp_path / "demo"
    out.mkdir()
    for name in tr.REPORT_FILES:
        (out / name).write_text(f"earlier {name}\n")
    (out / tr.MANIFEST).write_text('{"files": ["curves.png", "results.md", "runs.json"]}\n')
    before = {p.name: p.read_text() for p in out.iterdir()}
    for args in (["--device", "bogus:"], ["--sim", "bogus:"], ["--recipe", "mxint8"], ["--model", "no_such_module:build"]):
        assert cli.main(["train", *args, "-o", str(out)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert {p.name: p.read_text() for p in out.iterdir()} == before


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """``hbfp info emu | head -1``: stdout's reader gone, no traceback, no 'Exception ignored'."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([*HBFP, "info", "emu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    p.stdout.close()  # gone before the command prints: its first write meets a closed pipe
    with p.stderr:
        err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert err == "", err
    r = subprocess.run(f"{' '.join(HBFP)} info emu | head -1", shell=True, capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert r.stdout.startswith("device emu") and r.stderr == "", r.stderr
