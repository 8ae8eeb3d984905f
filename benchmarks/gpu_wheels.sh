#!/usr/bin/env bash
# Fills .whl/ (in .gitignore) with the wheels that benchmarks/gpu_check.sh needs on the device machine, whose
# python3 (3.12, x86-64) has torch, accelerate, tokenizers, huggingface_hub, safetensors, numpy, pandas, pyarrow,
# jinja2 and pyyaml but no registry to install from. Each package at the version installed in this project's
# environment (PYTHON, default python3: run `make bench-deps` there first for TRL and datasets), without
# dependencies, for CPython 3.12 on manylinux x86-64:
# - transformers: ours, not the device's 5.17 (the engine calls models with `cache=` and reads `out.cache`,
#   which 5.17 names `past_key_values`); with it what it checks at import and the device's are too old for:
#   regex, tokenizers, huggingface-hub 2 (and its httpx2, httpcore2, truststore, hf-xet, click) and kernels
#   (with tomlkit);
# - peft: ours, for the LoRA folding the engine does through peft's layers;
# - pydantic and its own dependencies: engine.spec.config validates the job spec with it (none on the device);
# - TRL and datasets with dill and multiprocess: the TRL contestant (none on the device).
# Then, on the device: run with carry [".whl"] and the command `bash benchmarks/gpu_check.sh`, which installs
# them with `python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
# /tmp/site .whl/*.whl` and puts /tmp/site on PYTHONPATH after the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
names=(transformers regex tokenizers huggingface-hub httpx2 httpcore2 truststore hf-xet click kernels tomlkit peft pydantic pydantic-core annotated-types typing-inspection typing-extensions
    trl datasets dill multiprocess)
pins=()
for name in "${names[@]}"; do
    version=$("$py" -c "import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))" "$name") ||
        { echo "$name is not installed in $py's environment (make install bench-deps)" >&2; exit 1; }
    pins+=("$name==$version")
done
rm -rf .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -1 .whl
du -sh .whl
