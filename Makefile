# Every target that needs Python creates .venv first if it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# 2 workers on the CI machine; override with `make test PYTEST_WORKERS=0` to run serially.
PYTEST_WORKERS ?= 2
OUTPUT ?= results

.PHONY: venv run test test-slow test-all lint format bench docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,docs,hf]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pyro-bdl compare --output $(OUTPUT)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m ''

lint: $(STAMP)
	$(BIN)/ruff check pyro_bdl tests benchmarks examples docs/conf.py
	$(BIN)/ruff format --check pyro_bdl tests benchmarks examples docs/conf.py
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix pyro_bdl tests benchmarks examples docs/conf.py
	$(BIN)/ruff format pyro_bdl tests benchmarks examples docs/conf.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

# The API reference, the design notes and the stored tutorials as HTML in docs/_build/html; any
# Sphinx warning fails the build. The notebooks are rendered with their stored outputs, not run.
docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache docs/_build docs/tutorials
