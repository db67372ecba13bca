# The two commands of the README, `make demo` and `make test`, and `make docs`. Each builds its own
# venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdproxy-installed

COMPILED := build/compiled
ABS_BIN := $(abspath $(BIN))

.PHONY: demo docs test lint typecheck vllm-env unit integration vllm bench compiled test-compiled clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The demo gets a venv of its own with only what it needs (pdproxy, its fake workers and the
# openai client): no test tools, no torch. PORT= and REGISTRY_PORT= pick the ports.
DEMO_VENV ?= .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.pdproxy-demo-installed

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DEMO_VENV)/bin/python -m pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/python -m pdproxy demo $(if $(PORT),--port $(PORT)) $(if $(REGISTRY_PORT),--registry-port $(REGISTRY_PORT))

# The documentation site (mkdocs.yml) in site/, built strictly: a broken relative link or anchor
# fails it. NO_MKDOCS_2_WARNING silences mkdocs-material's banner about MkDocs 2, which the docs
# extra's `mkdocs<2` already keeps out.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.pdproxy-docs-installed

$(DOCS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/python -m mkdocs build --strict --site-dir site

test: lint typecheck vllm-env
	$(BIN)/python -m pytest -q -p no:cacheprovider
	$(MAKE) test-compiled

# The compiled build (setup.py, PDPROXY_COMPILE=1: the hot path through mypyc), made in a copy of
# the checkout so that the checkout stays pure Python and an edit is never shadowed by a stale
# extension module. Benchmark it with `cd build/compiled && ../../.venv/bin/python benchmarks/...`.
compiled: $(STAMP)
	rm -rf $(COMPILED)
	mkdir -p $(COMPILED)
	tar -c --exclude=./.venv --exclude=./.venv-demo --exclude=./.venv-docs --exclude=./site \
		--exclude=./.git --exclude=./build --exclude=./.mypy_cache . | tar -x -C $(COMPILED)
	cd $(COMPILED) && PDPROXY_COMPILE=1 $(ABS_BIN)/python setup.py --quiet build_ext --inplace

# The unit and integration tests again, against the compiled copy (the processes they start run
# it too: they inherit PYTHONPATH). PDPROXY_EXPECT_COMPILED makes a test check that they do.
test-compiled: compiled
	cd $(COMPILED) && PDPROXY_EXPECT_COMPILED=1 PYTHONPATH=$(abspath $(COMPILED)) \
		$(ABS_BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/integration

# Real vLLM (CPU build) for the `vllm` tests: installed once into a cached venv outside the repo
# (about 2 minutes the first time). PDPROXY_SKIP_VLLM=1 skips both the install and those tests.
vllm-env: $(STAMP)
	@if [ "$${PDPROXY_SKIP_VLLM:-0}" = "1" ]; then \
		echo "PDPROXY_SKIP_VLLM=1: real-vLLM tests will be skipped"; \
	else \
		$(BIN)/python -m tests.harness.vllm_env install; \
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
	rm -rf $(VENV) $(DEMO_VENV) $(DOCS_VENV) site build *.egg-info
