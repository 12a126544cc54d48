# tensorkv developer entry points.  `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_PIN := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test venv install install-test redis-server lint bench-quick bench-kv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

# The torch pin keeps pip on the CPU wheel instead of a multi-GB CUDA build.
install: venv
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[all]"

install-test: install
	$(PIP) install -q -e ".[all,dev]"

redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
		echo "installing redis-server (Debian package)"; \
		SUDO=""; [ "$$(id -u)" = "0" ] || SUDO="sudo"; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server redis-tools; \
	fi

demo: install
	$(VENV)/bin/tensorkv demo --path ./tensorkv-data

# pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: install-test redis-server
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q $(PYTEST_ARGS) || rc=$$?; \
	if [ "$${rc:-0}" = "5" ]; then echo "no tests collected"; exit 0; fi; exit $${rc:-0}

lint: install-test
	$(VENV)/bin/ruff check src tests

bench-quick: install
	$(VENV)/bin/tensorkv bench kv --quick

# The full key-value benchmark behind docs/benchmarks.md (about 10 minutes, 600 MB of data).
bench-kv: install
	$(VENV)/bin/tensorkv bench kv --json bench-kv.json

clean:
	rm -rf $(VENV) tensorkv-data .pytest_cache .ruff_cache build dist src/*.egg-info
