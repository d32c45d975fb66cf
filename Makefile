# Two entry points (README): `make run` and `make test`. Both create .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup system-deps lint typecheck unit proto clean

$(STAMP): requirements/dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --require-hashes -r requirements/dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

# Debian packages the tests start for real: etcd-server (metadata backend, cluster tests) and
# a headless Java 17 runtime (the PySpark connector tests run a local Spark).
system-deps:
	@command -v etcd >/dev/null 2>&1 || test -x /usr/bin/etcd || { \
	  echo "installing Debian etcd-server"; \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq etcd-server >/dev/null; }
	@command -v java >/dev/null 2>&1 || { \
	  echo "installing Debian openjdk-17-jre-headless (PySpark connector tests)"; \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq openjdk-17-jre-headless >/dev/null; }

run: setup
	$(BIN)/anabranch standalone

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: setup
	$(BIN)/mypy

proto: setup
	$(BIN)/python -m anabranch.protocol.generate --check

# Two workers: the suite mostly waits (broker, etcd, Spark and JVM processes, fsyncs), so
# two halve its wall time on a 2-core machine; a test module stays on one worker, so its
# module-scoped fixtures (a Spark session, a cluster) still start once.
PYTEST_WORKERS ?= 2

unit: setup system-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile

test: setup system-deps lint typecheck proto unit

clean:
	rm -rf $(VENV)
