#!/usr/bin/env bash
# Runs the whole suite (unit, property and multi-rank tests) with the project's .venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# two workers: the multi-rank jobs spend much of their time starting processes and waiting
exec .venv/bin/python -m pytest -q -n "${SBC_TEST_WORKERS:-2}" --durations=25 "$@"
