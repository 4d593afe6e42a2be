# Entry points a user types. Every target bootstraps its own environment on first use:
# a .venv with `pip install -e .[dev]`, so nothing installed by hand is assumed.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test bench accuracy clean distclean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## demo: the main job (for now: the golden-model demonstration of HBFP8 and MXINT8)
demo: $(STAMP)
	$(VENV)/bin/hbfp golden-demo

## test: the whole test suite (unit tests of every package and the simulator runs)
test: $(STAMP)
	$(PY) -m pytest -q

## bench: performance figures of the golden model against NumPy fp32
bench: $(STAMP)
	$(PY) benchmarks/bench_golden.py

## accuracy: measure the bf16 activation units over all inputs; rewrites docs/activations.md
accuracy: $(STAMP)
	$(PY) benchmarks/activation_accuracy.py

## clean: remove build outputs (keeps the environment)
clean:
	rm -rf build .pytest_cache .hypothesis
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +

## distclean: also remove the environment
distclean: clean
	rm -rf $(VENV) *.egg-info
