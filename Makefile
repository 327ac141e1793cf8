# Set-up is part of each target: a fresh clone needs only `make demo` or `make test`.
# torch==2.13.0 (the CPU build) is installed first, explicitly; GPU users install their own torch
# build and then `pip install -e .` (the project itself asks only for torch>=2.6).
VENV ?= .venv
BIN := $(VENV)/bin
# PyPI's torch for Linux is the CUDA build (about 2.7 GB); a CPU-only machine gets the small CPU build with
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=

.PHONY: demo test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# The main job: synthetic CosmoFlow universes (64^3), then CosmoFlow trained with dp=2 x spatial=2 on
# 4 local processes, validation MAE printed as it falls (about 3 minutes here).
demo: $(VENV)/.installed
	$(BIN)/hybridpar data synth-cosmoflow --out data/cosmoflow/train --num-samples 256 --size 64 --seed 0 --overwrite
	$(BIN)/hybridpar data synth-cosmoflow --out data/cosmoflow/val --num-samples 32 --size 64 --seed 1 --overwrite
	rm -rf runs/demo-cosmoflow
	$(BIN)/hybridpar train configs/cosmoflow.toml

test: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest
