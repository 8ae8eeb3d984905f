#!/usr/bin/env bash
# The GPU figures of benchmarks/README.md in one run, for a machine with one CUDA GPU (about 8 minutes on an
# H200): the CUDA-only tests, then ours against TRL and the floor at GPT-2-small shapes in bf16, the LoRA speed
# race, the logits race and the 1B-class shape. Needs `make bench-deps`. Output: one log per part in $OUT
# (default ./gpu-check).
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python -m pytest -q tests/engine/test_static_cache.py tests/engine/test_chunked_logprobs.py 2>&1 | tail -5 | tee "$out/tests.txt"
run() {  # name, then the benchmark's arguments
    local name=$1
    shift
    python benchmarks/ppo_vs_trl.py --dtype bfloat16 "$@" > "$out/$name.txt" 2>&1
    grep -v -i warn "$out/$name.txt" | tail -12
}
run small --sizes small --no-memory
run lora-small --lora-speed --sizes small
run logits-small --logits --sizes small
run 1b --sizes 1b --no-memory --updates 4
