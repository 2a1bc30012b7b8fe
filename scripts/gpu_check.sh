#!/usr/bin/env bash
# The GPU check: the CUDA family x scheme matrix (tests/core/test_cuda.py and the flex / Self-Extend device tests) and
# the speed benchmark in bf16 at 8,192 and 32,768 tokens, in under 8 minutes, every result under one folder.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]        # on a machine with a CUDA GPU, from the repository root
#   bash scripts/gpu_check.sh --rehearse [DIR]     # the same steps on the CPU, tiny sizes: checks the script itself
#   bash scripts/gpu_check.sh --scaling [DIR]      # instead: sharded fine-tuning at 16,384 tokens (about 5 minutes):
#       memory per configuration (one process, checkpointing, LoRA, FSDP2 + LoRA) and a 2-step FSDP2 LoRA
#       `finetune` through torchrun and an accelerate config, on a LLaMA of SmolLM2-135M's shape (random weights)
#
# Nothing is installed: it runs with the python3 found (torch with CUDA, transformers, accelerate, peft) and this
# checkout on PYTHONPATH. Each step has its own time limit and writes its results as it goes, so a step that runs
# out of time still leaves what it measured; the summary at the end says which steps finished.
set -uo pipefail

rehearse=0
scaling=0
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --rehearse) rehearse=1 ;;
        --scaling) scaling=1 ;;
        *) echo "gpu_check.sh: unknown option $1 (use --rehearse, --scaling)" >&2; exit 2 ;;
    esac
    shift
done
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

scaling_steps() {  # scaling_steps DEVICE DTYPE LENGTH MODEL: memory per configuration, then finetune under FSDP2
    local device=$1 dtype=$2 length=$3 model=$4
    step scaling_memory 300 "$python" scripts/benchmarks/bench_scaling_memory.py --model "$model" --device "$device" \
        --dtype "$dtype" --lengths "$length" --schemes alibi rope --configs plain ckpt lora fsdp-lora --world 1 \
        --budget-seconds 280 --json "$results/scaling_memory.json" --output "$results/scaling_memory.md"
    step save_model 120 "$python" -c "
import sys; sys.path.insert(0, 'scripts/benchmarks')
from transformers import LlamaConfig, LlamaForCausalLM
from bench_scaling_memory import SMOLLM2_SHAPE, TINY_SHAPE
from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer
shape = {**(SMOLLM2_SHAPE if '$model' == 'smollm2-shape' else TINY_SHAPE), 'max_position_embeddings': $length}
shape['vocab_size'] = max(shape['vocab_size'], BYTE_VOCAB_SIZE)
LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained('$results/model')
byte_tokenizer().save_pretrained('$results/model')"
    local stdlib
    stdlib=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    local fsdp=()
    if [[ $device == cuda ]]; then
        printf 'distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n' \
            > "$results/fsdp.yaml"
        fsdp=(--accelerate-config "$results/fsdp.yaml" --mixed-precision bf16)
    fi
    step finetune_fsdp_lora 240 "$python" -m torch.distributed.run --nproc_per_node 1 -m hf_posswap.cli.finetune \
        --model "$results/model" --scheme alibi --data "$stdlib/a*.py" "$stdlib/c*.py" --seq-len "$length" \
        --batch-size 1 --steps 2 --lora --gradient-checkpointing --output "$results/finetune" "${fsdp[@]}"
}

if (( scaling && rehearse )); then
    scaling_steps cpu float32 256 tiny
elif (( scaling )); then
    scaling_steps cuda bfloat16 16384 smollm2-shape
elif (( rehearse )); then
    export POSSWAP_TEST_DEVICE=cpu
    step cuda_matrix 600 "$python" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/core/test_cuda.py \
        -k "llama-alibi or bert-t5 or gpt2-kerple or auto or finetune or long" --junitxml="$results/cuda_matrix.xml"
    step bench 600 "$python" scripts/benchmarks/bench_speed.py --device cpu --dtype bfloat16 --quick --no-memory \
        --cases llama-alibi llama-self-extend --json "$results/bench.json" --output "$results/bench.md"
else
    # the matrix first (correctness before speed), then the benchmark with what is left of the 8 minutes
    # 8 workers: flex_attention compiles per scheme, dtype and mask pattern, on the CPU cores (16 there)
    step cuda_matrix 230 "$python" -m pytest -q -p no:cacheprovider -m "slow or not slow" -n 8 --timeout 120 \
        tests/core/test_cuda.py tests/core/test_flex_bias_gradients.py tests/core/test_self_extend_merged.py -k cuda \
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
