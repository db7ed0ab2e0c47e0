# journeyman: every command does its own set-up first (idempotent, cached under ~/.cache/journeyman).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: setup skypilot-env gpu-check test test-slow test-unit test-integration test-faults check docs docs-serve format bench demo clean

setup:  ## main environment, vLLM and SkyPilot environments, embedded models (JOURNEYMAN_UNSLOTH=1: with Unsloth, CUDA only)
	bash scripts/setup.sh

skypilot-env:  ## only SkyPilot's own environment, for `sky launch deploy/skypilot/journeyman-serve.yaml` (setup builds it too)
	bash scripts/skypilot-env.sh

# The GPU check (scripts/gpu_check.py): the trainer part on any CUDA machine, the serving part where
# `make setup` installed CUDA vLLM. No set-up first: a bare GPU machine runs it from carried wheels.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:  ## the GPU check: prints its tables (GPU_CHECK_ARGS=--cpu: the trainer part on the CPU, tiny)
	$(GPU_PY) scripts/gpu_check.py run $(GPU_CHECK_ARGS)

# `make test TIERS=` runs every tier in one session, the slow one last (as CI does); PYTEST_ARGS adds options.
TIERS ?= not slow
PYTEST_ARGS ?=

test: setup  ## unit, integration (real model, real vLLM environment), faults; all but the slow tier
	$(PY) -m pytest tests -q $(if $(TIERS),-m "$(TIERS)") -rs --durations=40 $(PYTEST_ARGS)  # -rs: each skip and its reason

test-slow: setup  ## the longest end-to-end runs (Qwen demo, RULER demo, merged Qwen, memory hand-back, short chaos run)
	$(PY) -m pytest tests -q -m slow --durations=10

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-integration: setup
	$(PY) -m pytest tests/integration -q

test-faults: setup  ## injected faults (vLLM and trainer killed, disk full, a short chaos run of an example), bad input, security
	$(PY) -m pytest tests/faults -q

check: setup  ## lint, format check, types (mypy strict on every module), the docs site and its markdown
	$(VENV)/bin/ruff check core integrations backend tests bench examples scripts
	$(VENV)/bin/ruff format --check core integrations backend tests bench examples scripts
	VENV=$(VENV) bash scripts/typecheck.sh
	$(MAKE) -o setup docs

# The pages that only include a root file (CHANGELOG.md, CONTRIBUTING.md) are linted as that file.
MARKDOWN := README.md CHANGELOG.md CONTRIBUTING.md $(wildcard examples/*/README.md) examples/README.md \
	$(filter-out docs/project/changelog.md docs/project/contributing.md,$(shell find docs -name '*.md'))
docs: setup  ## the docs site in build/site (mkdocs build --strict: a broken link or reference fails) and markdown lint
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(VENV)/bin/pymarkdown -d md013 scan $(MARKDOWN)

docs-serve: setup  ## the docs site on http://127.0.0.1:8000, rebuilt on each change
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

demo: setup  ## the main job: teach the embedded model a LangGraph tool task on this machine (~30 min on 2 cores)
	$(VENV)/bin/journeyman demo $(DEMO_ARGS)

bench: setup  ## timings (not tests): writes bench/results.md
	$(PY) -m bench.run

format: setup
	$(VENV)/bin/ruff check --fix core integrations backend tests bench examples scripts
	$(VENV)/bin/ruff format core integrations backend tests bench examples scripts

clean:  ## removes the main environment (the caches under ~/.cache/journeyman stay)
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
