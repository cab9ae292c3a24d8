# Two commands set everything up on a fresh machine:
#   make run   install into .venv, run the demo workflow, build results/demo/report.html, then its LoRA
#              stage (config/demo_lora.yaml) and its DPO stage (config/demo_dpo.yaml), each on stage 1's node0,
#              build results/demo-lora/report.html and results/demo-dpo/report.html
#   make test  install into .venv (with the trackers' packages), run the test suite (all of it, as CI does)
# and while working (`make help` lists every target):
#   make dry-run    what a submission would run (CONFIG=my.yaml, PROFILE=profiles/slurm), then the jobs per
#                   partition and rule and the GPU-hours requested
#   make test-fast  the tests that start no torchrun, no real Snakemake run and no SLURM (< 3 min)
#   make status     where each training job of a run is (RUN=<run>, default the config's run:; ARGS=--watch)
#   make install-trackers  logging.trackers' optional packages, wandb and mlflow (requirements-trackers.txt)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha256sum requirements.lock | cut -c1-12)
TRACKERS_STAMP := $(VENV)/.trackers-$(shell cat requirements.lock requirements-trackers.txt | sha256sum | cut -c1-12)
# the trackers' packages, left out of `make lock` (they are pinned in their own file)
TRACKER_PKGS := $(shell sed -nE 's/^([A-Za-z0-9_.-]+)==.*/\1/p' requirements-trackers.txt | paste -sd'|')
RUN ?= demo
# make dry-run's profile (CONFIG: its --configfile; none: config/config.yaml, the demo)
PROFILE ?= profiles/slurm
# the demo's second stage: LoRA with stage 1's results/demo/models/node0 as its base
LORA_CONFIG := config/demo_lora.yaml
LORA_RUN := demo-lora
# the demo's third stage: preference tuning (DPO) of stage 1's results/demo/models/node0
DPO_CONFIG := config/demo_dpo.yaml
DPO_RUN := demo-dpo
# Snakemake from the venv, not activated: the rules find the venv's python and torchrun beside it
SNAKEMAKE := $(VENV)/bin/snakemake
# the suite on TEST_WORKERS pytest-xdist workers, a group of tests (a test file, or the SLURM cluster tests) at a
# time on one, the longest groups first (tests/scheduling.py): its tests mostly wait on a subprocess, Snakemake or a
# SLURM poll with one core busy, so more workers than cores keep 2 cores busy (docs/benchmarks/test-suite.md:
# 2 workers 42 min, 3 workers 38.6-43.1, 4 workers 41: they contend). The fast tier's tests compute: FAST_WORKERS,
# one a core. 0: one process, as plain pytest
TEST_WORKERS ?= 3
FAST_WORKERS ?= 2
workers = $(if $(filter 0,$(1)),,-n $(1) --dist loadgroup)
PYTEST_WORKERS := $(call workers,$(TEST_WORKERS))
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-trackers run report status dry-run publish help test test-times test-fast lint format lock clean retrain

install: $(STAMP) ## install into .venv only (torch, then requirements.lock); trains nothing

# the stamp's name carries the lock's hash: a changed lock reinstalls, a touched one (a new checkout) does not
$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU wheel here, the CUDA build on a GPU cluster; deepspeed builds against it
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.lock
	rm -f $(VENV)/.installed-*
	touch $@

# optional (logging.trackers: wandb, mlflow); requirements.lock's versions stay as they are
install-trackers: $(TRACKERS_STAMP) ## logging.trackers' optional packages (wandb, mlflow)

$(TRACKERS_STAMP): $(STAMP)
	$(PY) -m pip install -q -r requirements-trackers.txt -c requirements.lock
	rm -f $(VENV)/.trackers-*
	touch $@

# Stages 2 and 3 are invocations of their own: their base model must exist when the workflow is parsed, and stage 1
# makes it.
run: install ## install, run the demo, its LoRA and DPO stages on this machine, build the three reports
	$(SNAKEMAKE) --cores all
	$(SNAKEMAKE) --report results/$(RUN)/report.html
	$(SNAKEMAKE) --cores all --configfile $(LORA_CONFIG)
	$(SNAKEMAKE) --report results/$(LORA_RUN)/report.html --configfile $(LORA_CONFIG)
	$(SNAKEMAKE) --cores all --configfile $(DPO_CONFIG)
	$(SNAKEMAKE) --report results/$(DPO_RUN)/report.html --configfile $(DPO_CONFIG)
	@echo; cat results/$(RUN)/eval/leaderboard.txt
	@echo "report: results/$(RUN)/report.html"
	@echo; echo "LoRA stage ($(LORA_CONFIG)): base = stage 1's node0, node0 = base + LoRA on a task stage 1 never saw"
	@cat results/$(LORA_RUN)/eval/leaderboard.txt
	@echo "report: results/$(LORA_RUN)/report.html"
	@echo; echo "DPO stage ($(DPO_CONFIG)): base = stage 1's node0 (the reference), node0 = base + DPO preferring answers that end with a full stop"
	@cat results/$(DPO_RUN)/eval/leaderboard.txt
	@echo "report: results/$(DPO_RUN)/report.html"

report: install ## rebuild results/<RUN>/report.html (RUN=demo) and the LoRA and DPO stages'
	$(SNAKEMAKE) --report results/$(RUN)/report.html
	test ! -d results/$(LORA_RUN) || $(SNAKEMAKE) --report results/$(LORA_RUN)/report.html --configfile $(LORA_CONFIG)
	test ! -d results/$(DPO_RUN) || $(SNAKEMAKE) --report results/$(DPO_RUN)/report.html --configfile $(DPO_CONFIG)

# snakemake publish: one publish_model per model of the config's publish.repo_id (rules/publish.smk), online (the hub)
publish: install ## upload publish.repo_id's models to the Hugging Face Hub (CONFIG=my.yaml, HF_TOKEN)
	HF_HUB_OFFLINE=0 $(SNAKEMAKE) --cores 1 publish $(if $(CONFIG),--configfile $(CONFIG)) $(ARGS)

# snakemake -n through PROFILE with CONFIG (ARGS: more Snakemake options), then dry_run_summary.py's table
dry-run: install ## what a submission would run (CONFIG=my.yaml PROFILE=profiles/slurm): jobs per partition, GPU-hours
	@$(PY) -m workflow_scripts.ops.dry_run_summary --profile $(PROFILE) $(if $(CONFIG),--configfile $(CONFIG)) $(ARGS)

help: ## this list: every target with one line
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  make %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# RUN only when given (make status RUN=x); otherwise status.py reads run: from CONFIG (config/config.yaml)
# NODE's checkpoints moved aside, then snakemake -R (through PROFILE when given, else here with --cores all) its train_state.json (its training from step 0, its model,
# evaluation, the summary and the pages), then the report (workflow_scripts/ops/retrain.py)
retrain: install ## train NODE=node1 again from step 0, then its evaluation, the summary and the report (CONFIG=, PROFILE=)
	$(PY) -m workflow_scripts.ops.retrain --config $(or $(CONFIG),config/config.yaml) --node $(NODE) \
	  $(if $(VARIANT),--variant $(VARIANT)) -- $(if $(filter-out file,$(origin PROFILE)),--profile $(PROFILE),--cores all)

status: install ## where each job of a run is (RUN=<run>, CONFIG=my.yaml, ARGS=--watch)
	@$(PY) -m workflow_scripts.ops.status $(if $(filter-out file,$(origin RUN)),--run $(RUN)) \
	  --config $(or $(CONFIG),config/config.yaml) $(ARGS)

test: install install-trackers ## the whole test suite, as CI runs it
	$(PY) -m pytest $(PYTEST_WORKERS)

# the suite as make test runs it, writing each group's seconds to tests/group_times.json: the order the workers take
# the groups in, longest first (tests/scheduling.py); commit the file after a change that moves a group's time a lot
test-times: install install-trackers ## make test, then tests/group_times.json rewritten from this run's times
	$(PY) -m pytest $(PYTEST_WORKERS) --write-group-times

# the markers are declared in pyproject.toml
test-fast: install ## the tests without torchrun, real Snakemake runs or SLURM (< 3 min)
	$(PY) -m pytest $(call workers,$(FAST_WORKERS)) -m "not e2e and not slurm and not torchrun"

lint: install ## snakemake --lint, snakefmt --check, ruff check
	$(SNAKEMAKE) --lint
	$(VENV)/bin/snakefmt --check .
	$(VENV)/bin/ruff check .

format: install ## snakefmt and ruff format
	$(VENV)/bin/snakefmt .
	$(VENV)/bin/ruff format .

lock: install ## rewrite requirements.lock from the venv
	{ echo "# Exact versions tested (pip freeze); torch==2.13.0 is installed first by the Makefile."; \
	  echo "# Regenerate with: make lock"; \
	  $(PY) -m pip freeze | grep -vE "^torch==|^-e |^pip==" | grep -viE "^($(TRACKER_PKGS))=="; } > requirements.lock

clean: ## remove results/, logs/ and .snakemake/ (models and checkpoints too)
	rm -rf results logs .snakemake
