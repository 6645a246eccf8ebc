#!/usr/bin/env bash
# The main job: a short SBC training on scikit-learn's digits (offline) on NP ranks,
# dense Horovod beside it, printing accuracy and the measured compression ratio.
# Launched with mpirun (horovodrun -np "$NP" -H localhost:"$NP" works the same; mpirun is
# used here because it does not tag every output line and starts faster).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP="${1:-2}"
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
exec mpirun --allow-run-as-root -np "$NP" -bind-to none -map-by slot -x PATH -x OMP_NUM_THREADS \
  python examples/pytorch_sbc_digits.py --methods dense,sbc --density 0.01 --delay 4 \
  --json "${DEMO_JSON:-/tmp/horovod_sbc_demo.json}"
