#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the whole test suite, real-checkpoint tests included.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k alibi`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -m pytest -m "slow or not slow" "$@"
