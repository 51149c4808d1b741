# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu gpu-wheels check install bench bench-net clean test-torch-dist

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip would byte-compile every module it installs (about 100,000 files, a
# minute on a 2-core machine); the jobs import about 3,000 of them. So: no
# compiling at install, and Python writes each module's cache at its first
# import instead (PYTHONDONTWRITEBYTECODE, where the environment sets it,
# would make every process compile torch again).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e ".[demo,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gradhub demo

check: $(STAMP)
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src

# Two pytest workers, each taking whole files (a file's module fixtures, such
# as the conformance jobs, run once): the multi-process tests spend much of
# their time waiting (process start, peers, timeouts), so one worker leaves
# about half of the 2-core machine idle (serial: 11.4 min, -n 2: 8.4). More
# workers gain little (-n 3: 7.7) and load the timing of failure tests.
test: check
	$(BIN)/python -m pytest -W error --durations=15 -n 2 --dist loadfile

# The tests that need CUDA (tests/gpu/ and the other `gpu`-marked ones; `make
# test` collects them too and skips them without CUDA): every strategy against
# plain training on one GPU, two ranks on one GPU over gloo, no host
# synchronisation in a step, the examples and the demo on CUDA, two-GPU NCCL
# (skipped below 2 GPUs). Under 5 minutes on one GPU. With the machine's own
# torch instead of the virtualenv's, once benchmarks/gpu_check.sh installed
# gradhub and pyzmq into /tmp/site (another torch's deprecation warnings are
# then no errors): `PYTHONPATH=/tmp/site make test-gpu GPU_PYTHON=python3
# GPU_WARNINGS=default`.
GPU_PYTHON ?= $(BIN)/python
GPU_WARNINGS ?= error
test-gpu:
	$(GPU_PYTHON) -m pytest -W $(GPU_WARNINGS) -rs --durations=15 -m gpu tests

# For a lent GPU machine (no network, Python 3.12, its own torch, no pyzmq):
# the pinned pyzmq as a wheel in .whl/ (git-ignored), which
# benchmarks/gpu_check.sh installs there with gradhub; see that script.
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 -d .whl \
		$$(grep -i '^pyzmq==' constraints.txt)

# torch's own distributed suite (DistributedTest._DistTestBase) on gloo, on the
# gradhub backend, and on gradhub under gloo's name (the cases torch gates on the
# name "gloo"), 2 ranks; long (hundreds of spawned cases). Counts in build/.
test-torch-dist: $(STAMP)
	mkdir -p build
	for b in gloo gradhub gradhub-as-gloo; do \
		BACKEND=$$b WORLD_SIZE=2 TEMP_DIR=$$(mktemp -d) $(BIN)/python -m pytest -q -rs \
			-p no:warnings -p no:cacheprovider --timeout 600 tests/backend/torch_dist_suite.py \
			--junitxml=build/torch-dist-$$b.xml | tail -3; \
	done

bench: $(STAMP)
	$(BIN)/python benchmarks/coordinator.py

bench-net: $(STAMP)  # needs root: emulated hosts in network namespaces
	$(BIN)/python benchmarks/network.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
