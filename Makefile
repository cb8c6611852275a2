# hkvd developer targets. Everything installs into .venv (VENV=PATH for another, e.g. a clean one without
# vLLM: `make test-fast VENV=/tmp/hkvd-clean`); torch comes from the CPU wheel on disk.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WHEELS ?= /opt/wheels
# Installs go through uv (in the venv, from PyPI): measured on a fresh 2-core machine, `-e '.[dev]'` took 6 s
# where pip took 66 s, and vLLM's CPU build 26 s where pip took about 3 minutes (docs/testing.md).
UV_VERSION := 0.13.9
UV := $(BIN)/uv pip
PIP := $(UV) install --python $(BIN)/python --find-links $(WHEELS)

.PHONY: dev vllm cluster serve test test-slow test-fast test-unit test-fault test-shim test-gpu check lint type bench bench-deps bench-peers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)

NIXL_VERSION := 1.5.1

# NIXL (peer links) declares a dependency on torch; --no-deps keeps the CPU torch in place
# (the [peer] extra cannot say --no-deps). numpy, its other dependency, is one of ours.
# Each install leaves a stamp in the venv, so the targets that need it (test-fast, test, ...) do not run pip
# again until pyproject.toml or the Makefile changes.
DEV_STAMP := $(VENV)/.hkvd-dev
VLLM_STAMP := $(VENV)/.hkvd-vllm
CLUSTER_STAMP := $(VENV)/.hkvd-cluster

$(DEV_STAMP): pyproject.toml Makefile | $(BIN)/uv
	$(PIP) -q -e '.[dev]'
	$(PIP) -q --no-deps nixl-cu12==$(NIXL_VERSION)
	touch $@

dev: $(DEV_STAMP)

# vLLM's CPU build for the shim's end-to-end tests (3.4 GB; 26 s with uv on a fresh 2-core machine). vLLM pulls torchvision,
# torchaudio and torchcodec, which break `import vllm` beside the CPU torch: remove them.
$(VLLM_STAMP): $(DEV_STAMP)
	$(PIP) -q -e '.[dev,vllm]'
	$(UV) uninstall --python $(BIN)/python -q torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_STAMP)

serve: dev
	$(BIN)/hkvd serve

# The cluster tier (hkvd serve --cluster): Mooncake Store's CPU client, which needs the OS package
# libibverbs1 even over TCP (installed here when missing, as root or through sudo).
$(CLUSTER_STAMP): $(DEV_STAMP)
	$(PIP) -q -e '.[dev,cluster]'
	touch $@

cluster: $(CLUSTER_STAMP)
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q libibverbs1 || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q libibverbs1; }; }

# The full suite but the soaks, as CI runs it (README's test command).
test: vllm cluster
	$(BIN)/pytest -q -m "not slow" tests

# The soaks (the `slow` marker): minutes of load on a daemon or a daemon pair, then its memory and what it
# left behind checked. Run before a release and after a change to the pool, the index or the peer links.
test-slow: vllm cluster
	$(BIN)/pytest -q -m slow tests

# In-process unit tests only (the `fast` marker: every tests/unit test that starts no process and uses no
# vLLM, tests/unit/conftest.py): under a minute on 2 cores. test-fast and test-unit need no vLLM (its tests
# skip): CI runs both in a clean venv without it (.ci/run). The fast tier runs on two workers (pytest-xdist):
# 27 s where one took 35 s on 2 cores.
test-fast: dev
	$(BIN)/pytest -q -m fast -n 2 tests

# All of tests/unit (processes included) and the end-to-end tests against a real hkvd serve.
test-unit: dev
	$(BIN)/pytest -q tests/unit tests/e2e

test-fault: dev
	$(BIN)/pytest -q tests/fault

test-shim: vllm
	$(BIN)/pytest -q tests/shim

# On a CUDA machine: GPU tests and the GPU bench (they skip, with a reason, where there is no GPU).
# The CuPy extra follows torch's CUDA major (gpu-cu12 or gpu-cu13): CuPy for another major than the
# CUDA libraries torch brought fails at the first copy. CUDA=12|13 overrides it.
TORCH_CUDA = $(shell $(BIN)/python -c "import torch; print((torch.version.cuda or '12').split('.')[0])" 2>/dev/null)
CUDA ?= $(or $(TORCH_CUDA),12)
test-gpu: dev
	@case "$(CUDA)" in 12|13) ;; *) echo "test-gpu: CUDA major $(CUDA) has no extra (gpu-cu12, gpu-cu13)"; exit 2;; esac
	$(UV) uninstall --python $(BIN)/python -q cupy-cuda$(if $(filter 12,$(CUDA)),13,12)x
	$(PIP) -q -e '.[dev,gpu-cu$(CUDA)]' || true
	HKVD_REQUIRE_GPU=1 $(BIN)/pytest -q -m gpu tests/gpu
	$(BIN)/python bench/gpu_copy.py
	$(BIN)/python bench/gpu_store_retrieve.py
	$(BIN)/python bench/gpu_interference.py

lint: dev
	$(BIN)/ruff check daemon shim transport cuda tests bench

# mypy reads the packages as hkvd.* (a link named hkvd to the checkout), so imports across them are
# checked: checking the folders by path leaves every hkvd.* import unresolved (Any).
MYPY_ROOT := .mypy-root
type: dev
	mkdir -p $(MYPY_ROOT) && ln -sfn "$(CURDIR)" $(MYPY_ROOT)/hkvd
	cd $(MYPY_ROOT) && MYPYPATH=. ../$(BIN)/mypy --config-file ../pyproject.toml \
	  -p hkvd.daemon -p hkvd.shim -p hkvd.transport -p hkvd.cuda

check: lint type test

# Full mode (about 11 minutes on 2 cores); `.venv/bin/python -m bench all --quick` is the 2-minute smoke.
bench-deps: dev
	$(PIP) -q -e '.[dev,bench]'

bench: bench-deps
	$(BIN)/python -m bench all

# LMCache 0.5.6 in its own venv (1.9 GB): torch's CPU wheel from $(WHEELS) goes in first, so
# lmcache's unpinned torch is already satisfied and pip does not pull CUDA torch (5.9 GB).
LMC := .bench-lmcache
bench-peers: bench-deps
	$(LMC)/bin/python -c 'import lmcache' 2>/dev/null || \
	  ($(PY) -m venv $(LMC) && $(LMC)/bin/pip install -q --upgrade pip && \
	   $(LMC)/bin/pip install --find-links $(WHEELS) torch==2.13.0 && \
	   $(LMC)/bin/pip install --find-links $(WHEELS) lmcache==0.5.6 torch==2.13.0)
	$(BIN)/python -m bench control_plane --lmcache-venv $(LMC)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
