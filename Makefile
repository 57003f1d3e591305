# Every target that needs Python creates .venv first if it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# 2 workers on the CI machine; override with `make test PYTEST_WORKERS=0` to run serially.
PYTEST_WORKERS ?= 2
OUTPUT ?= results

.PHONY: venv run test test-slow test-all lint format bench docs clean gpu-wheels gpu-check \
	gpu-payload gpu-quality

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,docs,hf]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# One torch thread (the command's default, stated here): the networks are small, and runs with
# torch's default thread count were 4-11x slower when several shared a machine.
run: $(STAMP)
	$(BIN)/pyro-bdl compare --threads 1 --output $(OUTPUT)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)

# --dist loadgroup: the tests of one `xdist_group` share a worker, and with it the runs they
# cache (the IVON/VOGN quality check trains every method once per data set for all its claims).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m ''

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

# The GPU check (docs/gpu.md). `make gpu-wheels` here, with PyPI reachable: the wheels the lent
# GPU machine (Python 3.12, torch, no network) lacks, one pinned version each so that pip never
# sees two, into the git-ignored .whl/ that travels with the working tree. `make gpu-check` there:
# no venv (nothing to install from), the wheels into /tmp/site unless pyro is already importable.
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS := pyro-ppl==1.9.2 pyro-api==0.1.2 arviz==1.3.0 arviz-base==1.3.1 arviz-stats==1.3.3 \
	arviz-plots==1.3.2 xarray-einstats==0.11.0 h5netcdf==1.8.2
GPU_SITE ?= /tmp/site
# e.g. GPU_CHECK_ARGS="--parts steps,match"
GPU_CHECK_ARGS ?=

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: \
		--python-version $(GPU_PYTHON_VERSION) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	du -sh .whl

gpu-check:
	$(PYTHON) -c "import pyro, arviz" 2>/dev/null || $(PYTHON) -m pip install -q --no-index --no-deps \
		--no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE):$$PWD $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The full-size quality benchmarks on the GPU machine (benchmarks/gpu_quality.py). `make
# gpu-payload` here: the data folders and all-MiniLM-L6-v2 (float16-rounded weights, to fit the
# transfer limit) into the git-ignored .gpu_payload/ that travels with the working tree.
GPU_PAYLOAD ?= .gpu_payload
GPU_QUALITY_OUTPUT ?= results/gpu-quality
gpu-payload: $(STAMP)
	test -n "$$PYRO_BDL_DATA" || (echo "set PYRO_BDL_DATA to the data folder" >&2; exit 2)
	rm -rf $(GPU_PAYLOAD) && mkdir -p $(GPU_PAYLOAD)/data
	cp -r "$$PYRO_BDL_DATA"/uci "$$PYRO_BDL_DATA"/mnist-test "$$PYRO_BDL_DATA"/sst2 $(GPU_PAYLOAD)/data/
	$(BIN)/python -m benchmarks.lora --export-fp16 $(GPU_PAYLOAD)/minilm-fp16
	du -sh $(GPU_PAYLOAD)

gpu-quality:
	$(PYTHON) -c "import pyro, arviz" 2>/dev/null || $(PYTHON) -m pip install -q --no-index --no-deps \
		--no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE):$$PWD $(PYTHON) -m benchmarks.gpu_quality --output $(GPU_QUALITY_OUTPUT) \
		--data-dir $(GPU_PAYLOAD)/data --model-dir $(GPU_PAYLOAD)/minilm-fp16

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache docs/_build docs/tutorials
