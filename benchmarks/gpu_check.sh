#!/usr/bin/env bash
# The GPU figures of benchmarks/README.md in one run of at most 8 minutes, on a machine with one CUDA GPU and
# nothing to download from: ours against TRL and the Hugging Face floor, with ours under LoRA beside them, in
# bf16 at GPT-2-small shapes (`small`) and at a 1B-class shape (`1b`), each in the real-job case (mixed prompt
# lengths, EOS stops) and the fixed-shape case; then the CUDA tests. Every part runs under `timeout` with its own
# limit (a part that ends early lends its unused seconds to the next ones, so the limits' sum, 470 s, bounds the
# whole run); a part that fails or times out is reported and the next one runs. The races stop counting updates
# before their limit and keep what they measured.
#
# On the device machine (python3 with torch, no registry): build the wheels here first,
#   bash benchmarks/gpu_wheels.sh
# (fills .whl/, which git ignores), then run with carry [".whl"] and the command
#   bash benchmarks/gpu_check.sh
# The wheels in .whl/ are installed into /tmp/site (no index, no dependencies), which goes on PYTHONPATH after
# the repository root. Output under $OUT (default ./gpu-check): summary.md and logs.tar.gz (every part's whole
# log and figures), both rewritten after each part, so a run cut short still leaves them.
#
# CPU dry mode: `bash benchmarks/gpu_check.sh --dry` (or DRY=1): the same parts at the `tiny` size, one warm-up
# and two counted updates, on this machine's CPU (TRL races too where `make bench-deps` installed it). PYTHON
# names the interpreter (default python3); PARTS, a space-separated subset of the parts (small-real small-fixed
# 1b-real 1b-fixed tests), reruns only those.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${DRY:-0}
[[ ${1:-} == --dry ]] && dry=1
py=${PYTHON:-python3}
out=${OUT:-gpu-check}
mkdir -p "$out"
logs=$(mktemp -d) # every part's log and figures; tarred into $out after each part
# USE_HUB_KERNELS=0: transformers (5.25) would swap layers for kernels fetched from the hub at a model's first
# .eval() on CUDA, which needs a network; TRL and the floor race the same torch layers as ours.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false USE_HUB_KERNELS=0
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

if ((dry)); then
    sizes=(tiny) updates=2 warmup=1 dtype=float32
    declare -A limit=([env]=60 [tiny-real]=300 [tiny-fixed]=300 [tests]=300)
else
    sizes=(small 1b) updates=4 warmup=1 dtype=bfloat16
    declare -A limit=([wheels]=30 [env]=20 [small-real]=90 [small-fixed]=80 [1b-real]=90 [1b-fixed]=85 [tests]=75)
fi
parts=" wheels env ${PARTS:-${!limit[*]}} " # the wheels and the environment always
bank=0 # seconds the parts so far left unused, lent to the next ones

part() { # name, then its command (@RACE_LIMIT@: the part's limit less 20 s); run it, record it, write the summary
    local name=$1 start=$SECONDS rc
    shift
    [[ $parts == *" $name "* ]] || return 0
    local allowed=$((${limit[$name]} + bank))
    timeout -k 10 "$allowed" "${@//@RACE_LIMIT@/$((allowed - 20))}" >"$logs/$name.log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    bank=$((allowed > took ? allowed - took : 0))
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$allowed" >>"$logs/parts.tsv"
    "$py" -m benchmarks.gpu_summary "$logs" >"$out/summary.md" 2>"$logs/summary.err" || cat "$logs/summary.err"
    tar -czf "$out/logs.tar.gz" -C "$logs" .
    echo "$name: exit code $rc after $took s (limit $allowed s)"
}

read -r -d '' env_py <<'PY'
import importlib.metadata as metadata, subprocess, sys, torch
subprocess.run("nvidia-smi || echo no nvidia-smi", shell=True)
cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA device:", cuda)
for name in ("transformers", "peft", "accelerate", "tokenizers", "huggingface_hub", "trl", "datasets", "pydantic"):
    try:
        print(name, metadata.version(name), "from", metadata.distribution(name).locate_file(""))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
PY

if ((!dry)) && compgen -G ".whl/*.whl" >/dev/null; then  # the wheels are for the device's python3 (3.12)
    part wheels "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
fi
part env "$py" -c "$env_py"
for size in "${sizes[@]}"; do
    for case in real fixed; do
        part "$size-$case" "$py" -m benchmarks.ppo_vs_trl --sizes "$size" --cases "$case" --dtype "$dtype" \
            --contestants ours ours-lora trl floor --updates "$updates" --warmup "$warmup" --no-memory \
            --time-limit @RACE_LIMIT@ --json "$logs/$size-$case.json"
    done
done
# The CUDA tests: those with "cuda" in their name, in the engine's test files that ask for CUDA (skipped on a CPU).
part tests "$py" -m pytest -q -rA -p no:cacheprovider -k cuda $(grep -l "cuda.is_available" tests/engine/test_*.py)
echo "whole run: $SECONDS s; summary: $out/summary.md; logs: $out/logs.tar.gz"
rm -rf "$logs"
