# fusesearch — two commands: `make demo` and `make test` (both install first).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := dev,dist,plot
DEMO_MODEL  ?= zoo:resnet50
DEMO_DEVICE ?= h100-sxm
PYTEST_ARGS ?=
# test workers (pytest-xdist): one per CPU this process may run on, at most 4 (each holds its own
# planned zoo models); TEST_WORKERS=0 runs the suite in this process
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: install demo test test-all lint bench clean

install: $(STAMP)

# Re-installs only when pyproject.toml changed (idempotent; a no-op otherwise).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $(STAMP)

demo: install
	$(BIN)/fusesearch plan $(DEMO_MODEL) --device $(DEMO_DEVICE)

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-all: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "slow or not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check fusesearch costmodels tests benchmarks

bench: install
	$(BIN)/python benchmarks/bench_load.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
