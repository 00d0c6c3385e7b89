# Everything runs from the project's own virtual environment in .venv/.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint proofs bench bench-scale soak venv system-deps clean chaos stress

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

# Two processes, each taking whole test files: most tests wait on a Temporal
# server, a worker or a timer (one process used 40% of one core), so on two
# cores the suite takes about 20 minutes where one process took 36. Each
# process starts its own PostgreSQL cluster, servers and ports.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: venv system-deps lint
	$(VENV)/bin/pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# The write protocol model-checked with Spin (proofs/README.md): the model must
# hold and each broken variant must give a counterexample. Needs spin and gcc;
# builds in a temporary directory. tests/test_proofs.py runs it under `test`.
proofs:
	bash proofs/check.sh

# What the safety costs (issue 12), ours against bare in one run: approval
# round trip, throughput, claims, history, memory, crash → unknown, scaling
# (bench/README.md). Writes bench/results/latest.json; PROFILE=DIR also
# samples the workers with py-spy. `make test` runs the smoke form.
PROFILE ?=
bench: venv system-deps
	$(VENV)/bin/python -m bench --json bench/results/latest.json $(if $(PROFILE),--profile $(PROFILE))

# The scale curve alone (part of `make bench` too): runs/s with 1, 2 and 3
# worker processes on PostgreSQL, CPU per part; writes bench/results/scale.json.
bench-scale: venv system-deps
	$(VENV)/bin/python -m bench.scale --json bench/results/scale.json

# The memory soak: both workers do batch after batch of the throughput run
# for SOAK_SECONDS; prints each one's memory growth per run after warm-up.
# SOAK_ENV="NAME=VALUE ..." sets worker variables (a collector setting, say).
# Writes bench/results/soak.json. `make test` runs a few small batches.
SOAK_SECONDS ?= 600
SOAK_ENV ?=
soak: venv
	$(VENV)/bin/python -m bench.soak --seconds $(SOAK_SECONDS) --json bench/results/soak.json \
		$(foreach pair,$(SOAK_ENV),--worker-env $(pair))

# Chaos (issue 10): a contended workload under seeded faults for DURATION
# seconds, then the invariant checker and the canary scan; exit 1 on any
# violation, leak, or fault kind never injected. DB=postgres uses a throwaway
# PostgreSQL cluster (`make system-deps` installs it). `make test` runs a short
# one (tests/test_chaos.py).
SEED ?= 7
DURATION ?= 600
DB ?= sqlite

chaos: venv
	$(VENV)/bin/python -m chaos --seed $(SEED) --duration $(DURATION) --db $(DB)

# The suite's repeated tests at their long size (`make test` runs them short,
# to stay near 30 minutes): each race 500 times, the store's state machine
# over 100 sequences, the old/new store writes over more rounds and every
# case of their matrices (`make test` takes a fixed half).
stress: venv system-deps
	RACE_ROUNDS=500 STATE_MACHINE_EXAMPLES=100 REVIEW_ROUNDS=40 REVIEW_SEQUENCES=60 REVIEW_MATRIX=all \
		$(VENV)/bin/pytest tests/test_races.py tests/test_store_state_machine.py \
		tests/test_review_core_writes.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
