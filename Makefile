# moegen: the two commands a newcomer needs are `make generate MODEL=kimi_k3 SM=100` and `make test`.
# Each target sets up .venv first (torch 2.13 CPU build from local disk, then this project's deps).

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.moegen-installed

# Selection knobs of `make generate` (empty = use the target's declared selection).
MODEL        ?=
SM           ?=
PARALLEL     ?=
TACTIC       ?=
BACKEND      ?=
DRAFT_TACTIC ?=
DRAFT_BACKEND ?=
MODE         ?=

GEN_FLAGS := $(if $(SM),--sm $(SM)) $(if $(PARALLEL),--parallel $(PARALLEL)) \
	$(if $(TACTIC),--tactic $(TACTIC)) $(if $(BACKEND),--backend $(BACKEND)) \
	$(if $(DRAFT_TACTIC),--draft-tactic $(DRAFT_TACTIC)) \
	$(if $(DRAFT_BACKEND),--draft-backend $(DRAFT_BACKEND)) $(if $(MODE),--mode $(MODE))

.PHONY: setup test generate check bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

test: setup
	$(VPY) -m pytest

generate: setup
	@test -n "$(MODEL)" || { echo "usage: make generate MODEL=<model> [SM=] [PARALLEL=] [TACTIC=] [BACKEND=] [DRAFT_TACTIC=] [DRAFT_BACKEND=] [MODE=auto|require]"; echo "models: $$($(VPY) -m codegen list --names)"; exit 2; }
	$(VPY) -m codegen generate --model $(MODEL) $(GEN_FLAGS)

check: setup
	$(VPY) -m codegen check

bench: setup
	$(VPY) bench/toolchain.py
	@echo "GPU benchmarks run on an H200: python3 bench/moe_layer.py, python3 bench/ncu_cells.py, python3 bench/router.py and python3 bench/build.py; on two GPUs: python3 bench/layouts.py (see BENCHMARKS.md)"
