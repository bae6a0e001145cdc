# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs the pinned stack, runs `lmforge quickstart`
#   make test   creates .venv, installs the pinned stack, runs the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.lmforge-installed
# A plain `torch` requirement would pull a multi-GB CUDA build; the CPU build is pinned
# and installed first so nothing else can choose another.
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`: a third of two cores sat idle with one (single-threaded Python
# between tiny models' steps, waits on subprocesses). Whole files go to a worker (--dist loadfile), so a
# file's shared runs are made once; each worker computes on its share of the cores (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: install browser demo test test-fast test-integration lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[dev,ui]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/lmforge quickstart --out runs/quickstart

# The report's and the UI's browser tests drive Debian's Chromium (its package brings the fonts);
# Playwright is pointed at it, so nothing is downloaded outside the package registries.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

test: install browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not integration" --durations=40

test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not slow and not integration"

# llama-cpp-python compiles llama.cpp on install (several minutes), so only this target installs it.
test-integration: install
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install -c constraints.txt llama-cpp-python
	$(PY) -m pytest -q -m "integration"

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix src tests bench
	$(VENV)/bin/ruff format src tests bench

bench: install
	$(PY) bench/prep_text.py
	$(PY) bench/train_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
