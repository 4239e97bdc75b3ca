# Two commands a fresh machine needs: `make run` and `make test`. Everything else is set up on demand.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL ?= models/pdserve-tiny
APT_PKGS := libibverbs1 librdmacm1 libnuma1 spin prometheus
STUBS := services/common/gen/pdserve/v1/.stamp
PROTOS := $(wildcard protos/pdserve/v1/*.proto)

.PHONY: setup run test unit integration chaos formal bench bench-quick soak clean deps stubs model

setup: .deps-apt $(VENV)/.installed $(STUBS) $(MODEL)/config.json

# Debian packages that Mooncake needs even for tcp, and SPIN for the formal model.
.deps-apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# the CUDA build of Mooncake needs libcudart; hosts without CUDA take the non-cuda build
	$(PIP) install -q torch==2.13.0
	@if command -v nvidia-smi >/dev/null 2>&1; then extra="test,bench"; $(PIP) install -q mooncake-transfer-engine; else extra="cpu,test,bench"; fi; \
	$(PIP) install -q -e ".[$$extra]"
	@touch $@

$(STUBS): $(PROTOS) $(VENV)/.installed
	@mkdir -p services/common/gen
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=services/common/gen --grpc_python_out=services/common/gen --pyi_out=services/common/gen $(PROTOS)
	@touch $@

$(MODEL)/config.json: $(VENV)/.installed
	$(VENV)/bin/pdserve make-model --out $(MODEL) --preset tiny --seed 0

run: setup
	$(VENV)/bin/pdserve up --model $(MODEL)

test: setup
	$(PY) -m pytest -q -x --durations=15 tests/unit tests/deploy tests/integration tests/chaos
	$(MAKE) formal

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

formal: .deps-apt
	@if [ -f formal/check.sh ]; then bash formal/check.sh; else echo "formal: no model yet"; fi

soak: setup
	$(PY) -m tests.chaos.soak --minutes $${SOAK_MINUTES:-10}

bench: setup
	$(VENV)/bin/pdserve bench

bench-quick: setup
	$(VENV)/bin/pdserve bench --quick

clean:
	rm -rf services/common/gen .deps-apt
