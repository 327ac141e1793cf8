# Set-up is part of each target: a fresh clone needs only `make demo` or `make test`.
# torch==2.13.0 (the CPU build) is installed first, explicitly; GPU users install their own torch
# build and then `pip install -e .` (the project itself asks only for torch>=2.6).
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/hybridpar demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest
