# The two commands: `make run` (set up, convert the default model, serve) and `make test`.
VENV   ?= .venv
CONFIG ?= dev/appliance.toml
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup model run test test-unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-env.sh
	bash scripts/setup-env.sh $(VENV)
	touch $@

model: setup
	$(VENV)/bin/appliance model install-default

run: model
	$(VENV)/bin/appliance serve --config $(CONFIG)

# pytest's own exit status goes through unchanged: 5 ("no tests ran") fails the target.
test: model
	$(PY) -m pytest

test-unit: setup
	$(PY) -m pytest tests/unit

bench: model
	$(PY) bench/gateway_overhead.py

clean:
	rm -rf .dev .pytest_cache
