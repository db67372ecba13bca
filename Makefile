# The two commands of the README: `make demo` and `make test`. Each builds its own venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdproxy-installed

.PHONY: demo test lint typecheck vllm-env unit integration vllm bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pdproxy demo

test: lint typecheck vllm-env
	$(BIN)/python -m pytest -q -p no:cacheprovider

# Real vLLM (CPU build) for the `vllm` tests: installed once into a cached venv outside the repo
# (about 2 minutes the first time). PDPROXY_SKIP_VLLM=1 skips both the install and those tests.
vllm-env: $(STAMP)
	@if [ "$${PDPROXY_SKIP_VLLM:-0}" = "1" ]; then \
		echo "PDPROXY_SKIP_VLLM=1: real-vLLM tests will be skipped"; \
	else \
		$(BIN)/python -m pdproxy.testing.vllm_env install; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

vllm: vllm-env
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/vllm

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_proxy.py

clean:
	rm -rf $(VENV) build *.egg-info
