# The README's two commands: `make serve` and `make test`. Both set everything up first, as does
# `make lint`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rill-installed
AGENTS_VENV ?= .venv-agents
AGENTS_STAMP := $(AGENTS_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: serve test lint setup setup-agents setup-llamacpp bench clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages.
# requirements-no-deps.txt: packages whose own requirements rill must not install (see there).
$(STAMP): pyproject.toml requirements-no-deps.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-no-deps.txt
	$(BIN)/python -m pip install --quiet -e '.[test,lint,postgres,ray]'
	touch $(STAMP)

# The OpenAI Agents SDK for its conformance test, apart from rill's environment (see the file).
setup-agents: $(AGENTS_STAMP)

$(AGENTS_STAMP): requirements-agents.txt
	$(PYTHON) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/python -m pip install --quiet -r requirements-agents.txt
	touch $(AGENTS_STAMP)

# --runner llamacpp: the optional extra, compiled from llama-cpp-python's source distribution
# (CPU only). Not part of setup: it took 13 minutes on a loaded 2-core machine; without it the
# llama.cpp runner's tests are skipped with the reason.
setup-llamacpp: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip install --quiet -e '.[llamacpp]'

serve: $(STAMP)
	$(BIN)/rill serve $(ARGS)

# Without Debian's postgresql the PostgreSQL tests are skipped with the reason, as the browser
# tests are without chromium; .ci/run installs both and sets RILL_REQUIRE_POSTGRES=1, so CI fails
# rather than skip them.
test: $(STAMP) $(AGENTS_STAMP)
	RILL_AGENTS_PYTHON=$(abspath $(AGENTS_VENV))/bin/python $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# All three checks run even when one fails, so one pass shows everything to fix; the last line
# names the failed ones. The format check lists files, not diffs (`ruff format --diff` shows them).
LINT_PATHS := src tests benchmarks
lint: $(STAMP)
	@failed=""; \
	echo "== ruff check"; $(BIN)/ruff check $(LINT_PATHS) || failed="$$failed ruff-check"; \
	echo "== ruff format --check"; $(BIN)/ruff format --check --output-format concise $(LINT_PATHS) || failed="$$failed ruff-format"; \
	echo "== mypy"; $(BIN)/mypy || failed="$$failed mypy"; \
	if [ -n "$$failed" ]; then echo "make lint: FAILED:$$failed" >&2; exit 1; fi; \
	echo "make lint: ruff check, ruff format --check and mypy passed"

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) $(AGENTS_VENV) build src/*.egg-info
