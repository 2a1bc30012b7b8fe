#!/usr/bin/env bash
# The GPU check: the CUDA family x scheme matrix (tests/core/test_cuda.py and the flex / Self-Extend device tests) and
# the speed benchmark in bf16 at 8,192 and 32,768 tokens, in under 8 minutes, every result under one folder.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]        # on a machine with a CUDA GPU, from the repository root
#   bash scripts/gpu_check.sh --rehearse [DIR]     # the same steps on the CPU, tiny sizes: checks the script itself
#
# Nothing is installed: it runs with the python3 found (torch with CUDA, transformers, accelerate, peft) and this
# checkout on PYTHONPATH. Each step has its own time limit and writes its results as it goes, so a step that runs
# out of time still leaves what it measured; the summary at the end says which steps finished.
set -uo pipefail

rehearse=0
if [[ "${1:-}" == "--rehearse" ]]; then rehearse=1; shift; fi
results="${1:-${OUT:-gpu_results}}"
mkdir -p "$results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
python="${PYTHON:-python3}"
started=$(date +%s)
status=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to RESULTS/NAME.log, remember the outcome
    local name=$1 seconds=$2
    shift 2
    echo "== $name (limit ${seconds}s): $*"
    local begin=$(date +%s)
    timeout --kill-after=10 "$seconds" "$@" >"$results/$name.log" 2>&1
    local code=$?
    local took=$(( $(date +%s) - begin ))
    tail -n 5 "$results/$name.log"
    status+=("$name: exit $code after ${took}s$([[ $code == 124 || $code == 137 ]] && echo ' (time limit)')")
}

step environment 60 bash -c "
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo 'no nvidia-smi'
    $python -c 'import sys, torch, transformers, accelerate, peft; print(sys.version.split()[0], torch.__version__,
        transformers.__version__, accelerate.__version__, peft.__version__, torch.cuda.is_available(),
        torch.cuda.get_device_name() if torch.cuda.is_available() else \"cpu\")'
    $python -m hf_posswap doctor
"

if (( rehearse )); then
    export POSSWAP_TEST_DEVICE=cpu
    step cuda_matrix 600 "$python" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/core/test_cuda.py \
        -k "llama-alibi or bert-t5 or gpt2-kerple or auto or finetune or long" --junitxml="$results/cuda_matrix.xml"
    step bench 600 "$python" scripts/benchmarks/bench_speed.py --device cpu --dtype bfloat16 --quick --no-memory \
        --cases llama-alibi llama-self-extend --json "$results/bench.json" --output "$results/bench.md"
else
    # the matrix first (correctness before speed), then the benchmark with what is left of the 8 minutes
    # 8 workers: flex_attention compiles per scheme, dtype and mask pattern, on the CPU cores (16 there)
    step cuda_matrix 230 "$python" -m pytest -q -p no:cacheprovider -m "slow or not slow" -n 8 --timeout 120 \
        tests/core/test_cuda.py tests/core/test_flex_bias.py tests/core/test_self_extend_merged.py -k cuda \
        --junitxml="$results/cuda_matrix.xml"
    left=$(( 460 - ($(date +%s) - started) ))
    (( left < 120 )) && left=120
    # the cases with targets first; FIRE and Sandwich (measured, no targets) with what time is left
    step bench "$left" "$python" scripts/benchmarks/bench_speed.py --device cuda --dtype bfloat16 --lengths 8192 32768 \
        --cases llama-alibi llama-t5 llama-kerple llama-self-extend llama-fire llama-sandwich --repeats 3 \
        --budget-seconds $(( left - 20 )) --json "$results/bench.json" --output "$results/bench.md"
fi

{
    echo "gpu_check $(date -u +%FT%TZ), $(( $(date +%s) - started ))s in all"
    printf '%s\n' "${status[@]}"
} | tee "$results/summary.txt"
