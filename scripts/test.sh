#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the whole test suite, real-checkpoint tests included.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k alibi`).
#
# The suite runs in POSSWAP_TEST_WORKERS pytest-xdist workers (default 2, CI's cores; 0 runs it in this process, for
# pdb or -s), each given whole test files (module fixtures such as the ZeRO-3 set-up run once) and one torch thread
# (two workers of two threads each on two cores would fight over them). Most tests are tiny models, where Python's
# overhead outweighs the arithmetic.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
workers="${POSSWAP_TEST_WORKERS:-2}"
if [ "$workers" != 0 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
.venv/bin/python -m pytest -m "slow or not slow" -n "$workers" --dist loadfile "$@"
