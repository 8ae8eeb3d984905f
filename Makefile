# The README's two commands are `make demo` and `make test`; both install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint bench-deps gpu-wheels gpu-check-dry

# torch is installed first and pinned: a CPU build of 2.13.0 is what the CI machines carry, and an
# unpinned torch would pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[train,dev]'

demo: install
	$(PYTHON) -m jobs.cli demo

test: install
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

# Benchmarks only: TRL 1.12.0 (the last release with a PPO trainer) for benchmarks/ppo_vs_trl.py, installed
# without its dependencies so that it changes nothing of the pinned stack, then what it needs besides.
bench-deps: install
	$(PIP) install -q --no-deps trl==1.12.0
	$(PIP) install -q 'datasets>=4.7' 'accelerate>=1.4' jinja2

# The GPU check (benchmarks/gpu_check.sh, benchmarks/README.md): the wheels it carries to the device machine, at
# the versions installed here, and its CPU dry run.
gpu-wheels: bench-deps
	PYTHON=$(PYTHON) bash benchmarks/gpu_wheels.sh

gpu-check-dry: bench-deps
	PYTHON=$(PYTHON) bash benchmarks/gpu_check.sh --dry
