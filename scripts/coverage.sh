#!/usr/bin/env bash
# Line coverage of the package over the whole suite (`make coverage`): every Python process the
# suite starts -- pytest-xdist workers and each rank of the multi-rank Horovod jobs -- records
# its lines (coverage's process start-up hook, enabled by a .pth file in .venv only while this
# runs), then the data are combined and reported. Prints the report; writes
# benchmarks/results/coverage.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/python -m pip install -q coverage
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
work=$(mktemp -d)
pth="$site/zz_horovod_sbc_coverage.pth"
trap 'rm -f "$pth"; rm -rf "$work"' EXIT
cat > "$work/coveragerc" <<RC
[run]
source = horovod_sbc
parallel = true
data_file = $work/data
RC
echo 'import coverage; coverage.process_startup()' > "$pth"
COVERAGE_PROCESS_START="$work/coveragerc" bash scripts/test.sh "$@" || status=$?
.venv/bin/python -m coverage combine -q --rcfile="$work/coveragerc" "$work"
.venv/bin/python -m coverage report --rcfile="$work/coveragerc" --skip-empty --show-missing | tee benchmarks/results/coverage.txt
exit "${status:-0}"
