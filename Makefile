# Everything runs from the project's own virtual environment in .venv/.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint proofs bench venv system-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The embedded stack in the foreground (Temporal dev server + UI, worker) and
# the demo run; Ctrl-C stops all of it.
run: venv
	$(VENV)/bin/roundtable dev --demo

# PostgreSQL (the tests' throwaway cluster), Chromium (the UI browser check),
# docker-compose (validates docker-compose.yml): Debian packages, if missing.
system-deps:
	bash scripts/ensure-system-deps.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv system-deps lint
	$(VENV)/bin/pytest

# The write protocol model-checked with Spin (proofs/README.md): the model must
# hold and each broken variant must give a counterexample. Needs spin and gcc;
# builds in a temporary directory. tests/test_proofs.py runs it under `test`.
proofs:
	bash proofs/check.sh

# What the safety costs: store claims against a bare upsert, as ratios.
bench: venv
	$(VENV)/bin/python -m bench.claims

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
