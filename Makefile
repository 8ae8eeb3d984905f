# The README's two commands are `make demo` and `make test`; both install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint

# torch is installed first and pinned: a CPU build of 2.13.0 is what the CI machines carry, and an
# unpinned torch would pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

demo: install
	$(PYTHON) -m jobs.cli demo

test: install
	$(PYTHON) -m pytest -q

lint:
	ruff check .
	ruff format --check .
	mypy
