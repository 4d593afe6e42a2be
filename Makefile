# Entry points a user types. Every target bootstraps its own environment on first use:
# a .venv with `pip install -e .[dev]`, so nothing installed by hand is assumed.

SHELL   := /bin/bash
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# pip with patience for a flaky network: each download resumed up to 20 times, and the whole
# install tried up to 3 times (a download that fails after its resumes fails the install).
PIP     := for try in 1 2 3; do $(PY) -m pip install --quiet --retries 10 --resume-retries 20
PIP_END := && break; [ $$try = 3 ] && exit 1; echo "pip install failed (try $$try of 3); again in 10 s"; sleep 10; done

.PHONY: demo test bench scaleout fidelity accuracy sim sim-full fuzz verilog fpga fpga-report clean distclean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@# Icarus Verilog and ccache come from Debian; CI runs as root and installs them here.
	@if ! command -v iverilog >/dev/null || ! command -v ccache >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing iverilog and ccache from Debian (apt-get, as root)"; \
	    apt-get update -qq && apt-get install -y -qq iverilog ccache >/dev/null; \
	  else echo "note: apt-get install iverilog ccache (as root) for the Icarus runs and faster Verilator builds"; fi; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# pip 25.1 or newer, for --resume-retries below
	@for try in 1 2 3; do $(PY) -m pip install --quiet --retries 10 --upgrade 'pip>=25.1' && break; \
	  [ $$try = 3 ] && exit 1; sleep 10; done
	@# The CPU build of PyTorch first: a bare range with no torch installed pulls CUDA (GBs).
	@$(PIP) torch==2.13.0 $(PIP_END)
	@$(PIP) -e '.[dev]' $(PIP_END)
	touch $(STAMP)

## demo: the main job: Verilog of the default core, then trainings in FP32 and HBFP8 (emu), with
## SGD and AdamW, of an MLP and a CNN on digits and of a char-level MLP LM and a 2-layer
## transformer on Python's documentation, and one MLP epoch on the RTL under Verilator (sim);
## table and curves in build/demo/
demo: $(STAMP)
	@set -e; s=$$SECONDS; \
	(set -x; $(VENV)/bin/hbfp golden-demo); g=$$SECONDS; \
	(set -x; $(VENV)/bin/hbfp verilog -o build/verilog); v=$$SECONDS; \
	(set -x; $(VENV)/bin/hbfp train -o build/demo); t=$$SECONDS; \
	echo "make demo wall time: golden-demo $$((g - s)) s, verilog $$((v - g)) s, train $$((t - v)) s (total $$((t - s)) s)"

## test: the whole test suite (unit tests of every package and the simulator runs)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

## sim: the cocotb regression only (Icarus and Verilator); also part of `make test`
sim: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests/test_hw_*.py

## sim-full: the long regression (more vectors, exhaustive on both simulators; emu against the
## RTL on a stalling 16x16 configuration too; the conformance table on the default top; the
## second builds that make test leaves out, tests/conftest.py SIM_FULL_ONLY)
sim-full: $(STAMP)
	HBFP_SIM_FULL=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests/test_hw_*.py tests/test_emu_gateware.py \
	  tests/test_conformance.py tests/test_boards.py

## fuzz: the long protocol fuzz (20,000 bursts per emu configuration, 5,000 on the RTL, 4 seeds)
## and the conformance table on the default top
fuzz: $(STAMP)
	HBFP_FUZZ_FULL=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests/test_fuzz_protocol.py tests/test_conformance.py

## verilog: the default core (8x8, HBFP8, 96x96 buffers) and its components into build/verilog
verilog: $(STAMP)
	$(VENV)/bin/hbfp verilog -o build/verilog

## bench: emulation performance beside fp32 in one run: five training steps at 1 and 2 threads and
## beside a busy process, torch.compile against eager, the golden gemm 1024^3 against NumPy's fp32
## matmul, quantize throughput; JSON=FILE also writes every figure (with the CPU's features and
## the kernels used) to FILE
bench: $(STAMP)
	$(PY) benchmarks/bench.py $(if $(JSON),--json $(JSON))

## scaleout: data-parallel training on 2, 3 and 4 ranks (torch.distributed, gloo) with fp32,
## one-step and two-step HBFP8, MXINT8, error feedback on and off: the digits MLP and CNN and
## the char-LM with AdamW; one table of accuracy or loss, bytes, ratio to fp32's ring, step time
scaleout: $(STAMP)
	$(PY) benchmarks/scaleout.py

## fidelity: why HBFP8 with AdamW diverged on a language model: the char-level LM under recipes
## that differ in one thing each (nearest or stochastic gradients, per product, master weights)
fidelity: $(STAMP)
	$(PY) benchmarks/fidelity.py

## accuracy: measure the bf16 activation units over all inputs; rewrites docs/activations.md
accuracy: $(STAMP)
	$(PY) benchmarks/activation_accuracy.py

FPGA_STAMP := $(VENV)/.fpga-installed

$(FPGA_STAMP): $(STAMP)
	@$(PIP) -e '.[dev,fpga]' $(PIP_END)
	touch $(FPGA_STAMP)

## fpga: the open FPGA flow (YoWASP Yosys and nextpnr for ECP5 and iCE40) in the .venv
fpga: $(FPGA_STAMP)

## fpga-report: build every board (bitstreams: ECP5, iCE40; Quartus projects: Intel), measure
## the 8x8 core on its own (three placement seeds) and run the density experiment (whole BFP8,
## bf16 and fp16 cores on ECP5, with DSPs and LUT-only); rewrites docs/reports/boards.md,
## ecp5-core-8x8-s96.md/.json, density.md and summary.json (its density figures included)
fpga-report: $(FPGA_STAMP)
	$(PY) benchmarks/fpga_report.py --write

## clean: remove build outputs (keeps the environment)
clean:
	rm -rf build .pytest_cache .hypothesis
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +

## distclean: also remove the environment
distclean: clean
	rm -rf $(VENV) *.egg-info
