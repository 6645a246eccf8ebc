#!/usr/bin/env bash
# The one prepared command for a GPU machine (torch + CUDA + numpy; no Horovod, no TensorFlow,
# no network needed): the GPU check (benchmarks/bench_gpu.py: the device codec against the numpy
# reference, host syncs, kernels, speed, memory) and the synthetic benchmark (one process: dense,
# then SBC's drop-in over a loopback of 8 ranks), each under a timeout; 6 minutes at most.
#   OUT=/some/dir scripts/gpu_check.sh     (results: $OUT/gpu_check.json and the logs)
# Exits non-zero when the check disagrees or a part fails or times out.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu_check_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HOROVOD_SBC_KERNELS=0
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) \
  | tee "$OUT/gpu.txt"
"$PY" -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'numpy', numpy.__version__)" | tee -a "$OUT/gpu.txt"

status=0
timeout -k 3 235 "$PY" -m benchmarks.bench gpu --device cuda --json "$OUT/gpu_check.json" \
  2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu check: exit $rc"
[ "$rc" -eq 0 ] || status=1

# synthetic ResNet-50 (torchvision if present), bf16 autocast, batch 64: dense, then SBC
for args in "--compression none" "--compression sbc --density 0.01 --delay 1" \
            "--compression sbc --density 0.01 --delay 4"; do
  timeout -k 3 35 "$PY" examples/pytorch_synthetic_benchmark.py $args --amp --batch-size 64 \
    --num-warmup-batches 5 --num-batches-per-iter 5 --num-iters 5 \
    2>&1 | tee -a "$OUT/synthetic.log"
  rc=${PIPESTATUS[0]}
  echo "synthetic benchmark ($args): exit $rc" | tee -a "$OUT/synthetic.log"
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
