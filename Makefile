# lmcal: `make help` lists the targets. Every target sets up .venv first (torch pinned, then the package).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# The torch requirement installed before the package; override for another build, e.g.
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH_DEFAULT := torch==2.13.0
TORCH ?= $(TORCH_DEFAULT)
PROFILE ?= auto
PY := $(VENV)/bin/python
# pytest workers for the test targets (pytest-xdist; a test file stays on one worker, its threads cores // workers)
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile
STAMP := $(VENV)/.installed
# The torch requirement the venv holds (written with the stamp; a venv from before it: the default). Another TORCH
# makes the stamp out of date, and the install swaps torch alone (uninstalled, then installed), keeping the venv.
TORCH_FILE := $(VENV)/.torch
TORCH_WAS := $(or $(strip $(shell cat $(TORCH_FILE) 2>/dev/null)),$(TORCH_DEFAULT))
ifneq ($(TORCH_WAS),$(strip $(TORCH)))
TORCH_CHANGED := $(wildcard $(PY))
endif

.DEFAULT_GOAL := help
.PHONY: help install torch-changed test test-slow test-all lint bench smoke reproduce docs clean gpu-check gpu-wheels test-slurm

help: ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z_-]+:.*## /{printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  variables: TORCH='$(TORCH)' PROFILE=$(PROFILE) (auto|paper|paper_mini|paper_full|cpu|smoke|scale|scale_gpu) LMCAL_DATA_ROOT=<folder holding ptb/>"
	@echo "             ARGS='out=DIR taus=[5,10] ...' (reproduce: overrides of conf/reproduce/<profile>.yaml)"
	@echo "             TEST_JOBS=2 (test targets: pytest workers; 0 runs the tests in one process)"
	@echo "             FORCE=1 (reproduce: redo the stages whose settings changed, and those downstream)"
	@echo "  commands (in .venv/bin): lmcal-train lmcal-evaluate lmcal-reproduce lmcal-report lmcal-docs (python -m lmcal.<name>);"
	@echo "             shell completion: eval \"\$$(.venv/bin/lmcal-train -sc install=bash)\""

$(STAMP): pyproject.toml $(if $(TORCH_CHANGED),torch-changed)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_CHANGED),$(PY) -m pip uninstall --quiet --yes torch)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev,hf]"
	@printf '%s\n' '$(TORCH)' > $(TORCH_FILE)
	@touch $(STAMP)

# a prerequisite of the stamp only when TORCH differs from the torch the venv holds
torch-changed: ;

install: $(STAMP) ## create .venv: pinned torch first, then lmcal with its dependencies

test: $(STAMP) ## the fast tests, about 20 min on 2 cores in TEST_JOBS workers (real PTB through LMCAL_DATA_ROOT if set; slow tests excluded)
	$(PYTEST) -m "not slow and not slurm"

test-slow: $(STAMP) ## the slow tier, and the fast tests that need the real corpus (ptb; LMCAL_DATA_ROOT) (CI: after make test)
	$(PYTEST) -m "(slow or ptb) and not slurm"

test-all: $(STAMP) ## every test, the slow tier too, but the Slurm tier
	$(PYTEST) -m "not slurm"

test-slurm: $(STAMP) ## the Slurm tier: a single-node Slurm cluster on loopback (root; apt-get install slurm-wlm munge)
	$(PY) -m pytest -m slurm tests/slurm -s

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check src tests bench tools

bench: $(STAMP) ## training throughput and FLOP utilisation (prints a Markdown table)
	$(PY) bench/train_throughput.py

# On a GPU machine as it comes (a Python with a CUDA torch, no registry): `make gpu-check PY=python3` uses that Python
# and its torch, no venv; what it lacks of Hydra and OmegaConf travels as wheels from `make gpu-wheels` (.whl/).
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP)) ## the CUDA path in <= 18 min: gpu tests, PROFILE=paper_mini timed against its plan, Lightning steps, lookahead, CPU against CUDA (PY=python3 on a bare GPU machine; report in outputs/gpu-check/)
	$(PY) tools/gpu_check.py $(GPU_ARGS)

GPU_PYTHON ?= 3.12
gpu-wheels: ## fetch (needs a registry) the pure-Python wheels a bare GPU machine's Python lacks into .whl/ (GPU_PYTHON=3.12)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation py \
	  -d .whl hydra-core==1.3.8 omegaconf==2.3.1
	$(PYTHON) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # (no wheel on PyPI: built here)

smoke: $(STAMP) ## a tiny training run (under a minute) that writes metrics.json
	$(PY) -m lmcal.train experiment=smoke

# (LMCAL_WATCH_PID: make's own process; the pipeline ends itself, its stages and lock, if make is killed)
reproduce: $(STAMP) ## every result of the paper for PROFILE (auto: paper on a GPU, else cpu); resumable
	LMCAL_WATCH_PID=$$PPID $(PY) -m lmcal.reproduce profile=$(PROFILE) $(if $(filter 1 true yes,$(FORCE)),force=true) $(ARGS)

docs: $(STAMP) ## regenerate docs/RESULTS.md from docs/runs/ and docs/bench/ (RUNS='outputs/reproduce/cpu' snapshots first)
	$(PY) -m lmcal.docs $(if $(RUNS),--snapshot $(RUNS))

clean: ## remove .venv (outputs/ is kept)
	rm -rf $(VENV)
