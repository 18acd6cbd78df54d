# lmcal: `make help` lists the targets. Every target sets up .venv first (torch pinned, then the package).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# The torch requirement installed before the package; override for another build, e.g.
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH ?= torch==2.13.0
PROFILE ?= auto
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test test-all lint bench smoke reproduce docs clean gpu-check test-slurm

help: ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z_-]+:.*## /{printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  variables: TORCH='$(TORCH)' PROFILE=$(PROFILE) (auto|paper|paper_full|cpu|smoke|scale|scale_gpu) LMCAL_DATA_ROOT=<folder holding ptb/>"
	@echo "             ARGS='out=DIR taus=[5,10] ...' (reproduce: overrides of conf/reproduce/<profile>.yaml)"
	@echo "             FORCE=1 (reproduce: redo the stages whose settings changed, and those downstream)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev,hf]"
	@touch $(STAMP)

install: $(STAMP) ## create .venv: pinned torch first, then lmcal with its dependencies

test: $(STAMP) ## the fast tests, under ~5 min (real PTB through LMCAL_DATA_ROOT if set; slow tests excluded)
	$(PY) -m pytest -m "not slow and not slurm"

test-all: $(STAMP) ## every test, the slow tier too (what CI runs), but the Slurm tier
	$(PY) -m pytest -m "not slurm"

test-slurm: $(STAMP) ## the Slurm tier: a single-node Slurm cluster on loopback (root; apt-get install slurm-wlm munge)
	$(PY) -m pytest -m slurm tests/slurm -s

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check src tests bench

bench: $(STAMP) ## training throughput and FLOP utilisation (prints a Markdown table)
	$(PY) bench/train_throughput.py

gpu-check: $(STAMP) ## the CUDA path in a few minutes: gpu tests, throughput, a calibrated step, CPU against CUDA (needs CUDA; report in outputs/gpu-check/)
	$(PY) bench/gpu_check.py

smoke: $(STAMP) ## a tiny training run (under a minute) that writes metrics.json
	$(PY) -m lmcal.train experiment=smoke

reproduce: $(STAMP) ## every result of the paper for PROFILE (auto: paper on a GPU, else cpu); resumable
	$(PY) -m lmcal.reproduce profile=$(PROFILE) $(if $(filter 1 true yes,$(FORCE)),force=true) $(ARGS)

docs: $(STAMP) ## regenerate docs/RESULTS.md from docs/runs/ and docs/bench/ (RUNS='outputs/reproduce/cpu' snapshots first)
	$(PY) -m lmcal.docs $(if $(RUNS),--snapshot $(RUNS))

clean: ## remove .venv (outputs/ is kept)
	rm -rf $(VENV)
