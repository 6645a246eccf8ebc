#!/usr/bin/env bash
# Runs the whole suite (unit, property and multi-rank tests) with the project's .venv, on
# SBC_TEST_WORKERS pytest-xdist workers (default 2, one per core; 0 runs in one process): the
# tests that start heavy multi-process jobs stay on one worker, the light jobs together on
# another (tests/conftest.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec .venv/bin/python -m pytest -q --durations=25 -n "${SBC_TEST_WORKERS:-2}" --dist loadgroup "$@"
