# One-command set-up: every target creates the virtualenv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvroute-installed

.PHONY: serve test test-unit test-integration test-engine lint format typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvroute serve

# The whole suite: lint, types, then every test tier.
test: $(STAMP) lint typecheck
	$(PY) -m pytest tests

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration

test-engine: $(STAMP)
	$(PY) -m pytest -m engine tests

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/cachemap_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
