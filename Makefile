# horovod_sbc — the two commands a newcomer needs are `make demo` and `make test`.
# Both run `install` first (idempotent: seconds when nothing changed).
VENV   := .venv
PY     := $(VENV)/bin/python
NP     ?= 2

.PHONY: install demo test bench fuzz coverage clean

install:
	bash scripts/install.sh

demo: install
	bash scripts/demo.sh $(NP)

test: install
	bash scripts/test.sh

bench: install
	$(PY) -m benchmarks.bench all --json benchmarks/results/bench.json
	$(PY) -m benchmarks.bench tasks --tasks mnist1d_long --json benchmarks/results/tasks_long.json
	$(PY) -m benchmarks.bench downlink --json benchmarks/results/downlink.json
	$(PY) -m benchmarks.bench_tf_codec --json benchmarks/results/tf_codec.json
	$(PY) -m benchmarks.bench_ddp --json benchmarks/results/ddp.json
	$(PY) -m benchmarks.bench gpu-proxy --json benchmarks/results/gpu_proxy.json
	$(PY) -m benchmarks.bench soak --json benchmarks/results/soak.json
	$(PY) -m benchmarks.bench tf-train --json benchmarks/results/tf_vs_torch.json
	$(PY) -m benchmarks.quality --resume --json benchmarks/results/quality.json
	$(PY) -m benchmarks.quality --study screen --parts iid,skewed,lm_docs --resume --json benchmarks/results/quality_screen.json
	$(PY) -m benchmarks.quality --study shared --parts iid,skewed --resume --json benchmarks/results/quality_shared.json
	$(PY) -m benchmarks.quality --study adaptive --parts lm_docs,lm_iid,lm_iid8 --resume --json benchmarks/results/quality_adaptive.json
	$(PY) -m benchmarks.quality --study freeze --parts lm_docs,lm_iid --resume --json benchmarks/results/quality_freeze.json
	$(PY) -m benchmarks.quality --study oneline --parts lm_docs,lm_iid --resume --json benchmarks/results/quality_oneline.json
	$(PY) -m benchmarks.quality --study optimizers --parts opt_iid --resume --json benchmarks/results/quality_optimizers.json
	$(PY) -m benchmarks.bench gpu --device cpu --json benchmarks/results/gpu_check_cpu.json
# issue 45 (the one line: 3,000-step and second-corpus targets) and 46 (the reduce-scatter)
	$(PY) -m benchmarks.quality --study long --parts lm_docs3k,lm_iid3k --resume --json benchmarks/results/quality_long.json
	$(PY) -m benchmarks.quality --study long_density --parts lm_docs3k,lm_iid3k --resume --json benchmarks/results/quality_long_density.json
	$(PY) -m benchmarks.quality --study code --parts code_docs,code_iid --resume --json benchmarks/results/quality_code.json
	$(PY) -m benchmarks.quality --study code_long --parts code_docs3k,code_iid3k --resume --json benchmarks/results/quality_code_long.json
	$(PY) -m benchmarks.quality --study topology --parts iid,skewed,iid8,skewed8,lm_docs,lm_iid --resume --json benchmarks/results/quality_topology.json
	$(PY) -m benchmarks.quality --study downlink --parts iid,lm_docs,lm_iid,skewed,iid8,skewed8 --resume --json benchmarks/results/quality_downlink.json
	$(PY) -m benchmarks.quality --study downlink_exact --parts skewed --resume --json benchmarks/results/quality_downlink_exact.json
	$(PY) -m benchmarks.quality --study skewed_seeds --parts skewed --resume --json benchmarks/results/quality_skewed_seeds.json
	$(PY) -m benchmarks.quality --study topology8 --parts lm_docs8,lm_iid8 --resume --json benchmarks/results/quality_topology8.json
	$(PY) -m benchmarks.quality --study topology8_seeds --parts lm_docs8,lm_iid8 --resume --json benchmarks/results/quality_topology8_seeds.json
	$(PY) -m benchmarks.quality --study topology8_mnist_seeds --parts iid8,skewed8 --resume --json benchmarks/results/quality_topology8_mnist_seeds.json
	$(PY) -m benchmarks.quality --study topology8_density --parts lm_docs8,lm_iid8 --resume --json benchmarks/results/quality_topology8_density.json
	$(PY) -m benchmarks.bench scatter --reps 5 --json benchmarks/results/scatter_bench.json
# issue 61: the task matrix (the defaults, 3 seeds)
	$(PY) -m benchmarks.matrix --resume --json benchmarks/results/matrix.json

coverage: install
	bash scripts/coverage.sh

fuzz: install
	FUZZ_CASES=$${FUZZ_CASES:-1000000} DIFF_CASES=$${DIFF_CASES:-1000000} DIFF_TF_EVERY=10 \
	  $(PY) -m pytest -q tests/test_fuzz.py tests/test_differential.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
