#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the main job on the built-in default checkpoint.
# Extra arguments go to `hf-posswap demo` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/hf-posswap demo "$@"
