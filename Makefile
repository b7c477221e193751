# The three commands of Turbine: make setup, .venv/bin/turbine serve, make test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.turbine-installed

.PHONY: setup test test-unit clean

setup: $(STAMP)
	$(VENV)/bin/turbine model prepare

# Reinstall only when the project's declared dependencies change (a second run is fast).
$(STAMP): pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

test: setup
	bash scripts/run_tests.sh

test-unit: setup
	$(PY) -m pytest tests/unit -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
