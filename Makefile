# The two commands: `make run` and `make test`. Both create .venv here and
# install Ferry with the CPU build of PyTorch (pinned) unless told otherwise.
# The interpreter .venv is made from: the distribution's python3 where it will do, else
# python3 from the PATH (.ci/pick-python says why); PYTHON=... chooses another.
ifndef PYTHON
PYTHON := $(shell .ci/pick-python)
endif
VENV := .venv
BIN := $(VENV)/bin
# GPU users: make run TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers for make test: most tests wait on Redis, a database or a
# process starting rather than compute, so four share 2 cores (with three, the
# cores idled 12-16 % of a run once stacks forked their processes); the fault suite
# and the tests on hosts or ports of their own each keep to one worker
# (tests/conftest.py, XDIST_GROUPS). TEST_WORKERS=0 runs every test in pytest's
# own process.
TEST_WORKERS ?= 4
# make test's report (ignored by git): pytest's JUnit XML and durations, and the
# wall time of each other step (steps.tsv); make test-report prints it.
REPORT := .ferry/test-report
# Compiled once before pytest, so that the few hundred processes the suite starts read
# their bytecode instead of compiling every module again (where PYTHONDONTWRITEBYTECODE
# is set, none of them would write it): the sources, and the tests' helpers (their test
# modules and conftests pytest compiles itself, rewriting their asserts: tests/assert_cache.py
# writes those once, for the workers to read; should it fail, pytest runs all the same, each
# worker rewriting them again, and steps.tsv says so).
SOURCES := api backends bench core ferry harness scheduler workers clients/python tests
NOT_COMPILED := '/(test_[^/]*|conftest)\.py$$'
# Set by make test: where each step's wall time is appended (.ci/timed); empty, nothing is.
STEPS ?=
TIMED = .ci/timed "$(STEPS)"

.PHONY: run test test-report lint typecheck audit audit-soft docs unit clean

$(STAMP): pyproject.toml constraints.txt clients/python/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Ferry needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt --upgrade pip setuptools
	@# With the pinned torch: every pin of constraints.txt, three pips side by side (.ci/install-pinned),
	@# then Ferry with its dependencies (what a pin needs beyond the file comes then: the CUDA
	@# libraries of a torch taken from PyPI), and pip check for anything missing or at odds.
	@# Another torch (a CUDA build's index, another version) is installed first, as it is.
	if [ -z "$(TORCH_INDEX)" ] && grep -qx "$(TORCH_SPEC)" constraints.txt; then \
		.ci/install-pinned $(BIN)/python constraints.txt && \
		$(BIN)/python -m pip install --quiet -c constraints.txt -e clients/python -e '.[dev]' && \
		$(BIN)/python -m pip check; \
	else \
		$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)" && \
		$(BIN)/python -m pip install --quiet -c constraints.txt -e clients/python -e '.[dev]'; \
	fi
	touch $(STAMP)

# The shipped tiny-llama is served beside the defaults (its first start builds
# its files, random weights); FERRY_MODELS=... make run chooses otherwise.
run: $(STAMP)
	FERRY_MODELS="$${FERRY_MODELS:-minilm,sim,tiny-llama}" $(BIN)/ferry up

lint: $(STAMP)
	$(TIMED) ruff-check $(BIN)/ruff check .
	$(TIMED) ruff-format $(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(TIMED) mypy $(BIN)/mypy

# Known vulnerabilities in the pinned dependencies, from PyPI's advisory data.
AUDIT := $(BIN)/pip-audit -r constraints.txt --no-deps --disable-pip --progress-spinner off

# Fails when any dependency could not be checked, as well as on a vulnerability.
audit: $(STAMP)
	$(AUDIT) --strict

# What make test runs: fails on a known vulnerability; where PyPI's advisory
# data cannot be reached (offline, or a mirror without it), says so and goes on.
audit-soft: $(STAMP)
	@if ! $(TIMED) pip-audit $(AUDIT) > $(VENV)/audit.txt 2>&1; then \
		if grep -qi "known vulnerabilit" $(VENV)/audit.txt; then cat $(VENV)/audit.txt; exit 1; fi; \
		echo "pip-audit could not run: $$(tail -n 1 $(VENV)/audit.txt)"; \
	elif unchecked=$$(grep -c "could not be audited" $(VENV)/audit.txt); then \
		echo "pip-audit: no known vulnerabilities; $$unchecked dependencies could not be checked (run make audit where PyPI's advisory data can be reached)"; \
	else echo "pip-audit: no known vulnerabilities"; fi

# The documentation site (mkdocs.yml): any warning fails it, a broken link or
# anchor, or a page left out of the nav.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(TIMED) mkdocs $(BIN)/mkdocs build --strict --site-dir .site

# The virtual environment, then the checks beside pytest: pytest leaves part of a
# core idle while its tests wait, and the checks (mypy above all) fill it. Each
# step's wall time goes to $(REPORT)/steps.tsv; the checks' output is printed
# whole when they end (amid pytest's progress), and either failing fails make test.
test:
	@rm -rf $(REPORT) && mkdir -p $(REPORT)
	@.ci/timed $(REPORT)/steps.tsv venv $(MAKE) --no-print-directory $(STAMP)
	@( .ci/timed $(REPORT)/steps.tsv checks $(MAKE) --no-print-directory -j4 --output-sync=target \
		STEPS=$(REPORT)/steps.tsv lint typecheck audit-soft docs > $(REPORT)/checks.log 2>&1; \
		echo $$? > $(REPORT)/checks.status; printf '\n'; cat $(REPORT)/checks.log ) & \
	.ci/timed $(REPORT)/steps.tsv compile $(BIN)/python -m compileall -q -j 0 -x $(NOT_COMPILED) \
		$(SOURCES) > /dev/null; \
	.ci/timed $(REPORT)/steps.tsv assert-cache env -u PYTHONDONTWRITEBYTECODE \
		$(BIN)/python -m pytest -q -p tests.assert_cache; \
	.ci/timed $(REPORT)/steps.tsv pytest $(BIN)/python -m pytest -n $(TEST_WORKERS) \
		--dist loadgroup --durations=50 --junitxml=$(REPORT)/junit.xml $(PYTEST_ARGS); \
	tests=$$?; wait; checks=$$(cat $(REPORT)/checks.status); \
	if [ "$$checks" != 0 ]; then echo "make test: the checks failed (exit $$checks)"; fi; \
	if [ "$$tests" != 0 ]; then exit "$$tests"; fi; exit "$$checks"

# The slowest files and tests of the last make test, and the time of each other step.
test-report:
	@$(PYTHON) -m tests.suite_report $(REPORT)

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# The API's per-job path against a bare FastAPI endpoint (bench/api.py): about
# 7 minutes on 2 cores; writes bench/results/api.json. Needs wrk (installed with apt).
.PHONY: bench-api
bench-api: $(STAMP)
	@command -v wrk >/dev/null || apt-get install -y wrk
	$(BIN)/python -m bench.api $(BENCH_ARGS)

# minilm end to end: 64 closed-loop clients (wrk) against the raw model ceiling
# (bench/clients.py): about 8 minutes on 2 cores; writes bench/results/clients.json.
.PHONY: bench-clients
bench-clients: $(STAMP)
	@command -v wrk >/dev/null || apt-get install -y wrk
	$(BIN)/python -m bench.clients $(BENCH_ARGS)

# The same closed-loop clients against the raw model, Ray Serve's @serve.batch, a
# Celery task per request and Ferry (submit and long-poll; one round trip), side by
# side (bench/peers.py): about 12 minutes on 2 cores; writes bench/results/peers.json.
# Installs the bench extra (ray[serve], pinned in bench/constraints.txt) first.
.PHONY: bench-peers
bench-peers: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -c bench/constraints.txt -e '.[bench]'
	$(BIN)/python -m bench.peers $(BENCH_ARGS)

# Every benchmark the README and bench/README.md cite, one after the other,
# each rewriting its file in bench/results/, then the documents rendered from
# them (python -m bench.render): hours on 2 cores (python -m bench list).
.PHONY: bench
bench: $(STAMP)
	@command -v wrk >/dev/null || apt-get install -y wrk
	$(BIN)/python -m pip install --quiet -c constraints.txt -c bench/constraints.txt -e '.[bench]'
	$(BIN)/python -m bench all $(BENCH_ARGS)

# Each benchmark for seconds, into a temporary folder, never bench/results/:
# proves they still run and render (make test runs it, tests/e2e/test_bench_smoke.py).
.PHONY: bench-smoke
bench-smoke: $(STAMP)
	@command -v wrk >/dev/null || apt-get install -y wrk
	$(BIN)/python -m bench all --smoke --parallel 3 $(BENCH_ARGS)

# Mutation testing (bench/mutation.py, mutmut): scheduler/ against its unit
# tests, then the recorder's terminal write against the integration tests that
# write outcomes (Redis, SQLite): 10 to 15 minutes on 2 cores, never part of
# make test. Writes bench/results/mutation.json; MUTATION_ARGS="--target scheduler".
.PHONY: mutation
mutation: $(STAMP)
	FERRY_BENCH_MAKE="make mutation" $(BIN)/python -m bench.mutation $(MUTATION_ARGS)

# The fault-injection suite alone (tests/faults, as make test runs it), its figures
# written to bench/results/faults.json and rendered into docs/reliability.md's fault
# tables: about 8 minutes on 2 cores.
.PHONY: faults
faults: $(STAMP)
	FERRY_FAULTS_RESULTS=bench/results/faults.json $(BIN)/python -m pytest tests/faults \
		-n $(TEST_WORKERS) --dist loadgroup -p no:randomly -q
	$(BIN)/python -m bench.render

# The overload test at its full length (tests/faults/test_overload.py): a flood at ten
# times the sim's capacity for 60 s beside urgent jobs (make test runs it for 20 s);
# about 2 minutes. Prints the scenario's figures.
.PHONY: overload
overload: $(STAMP)
	FERRY_OVERLOAD_S=60 $(BIN)/python -m pytest tests/faults/test_overload.py -p no:randomly -q -s

# The one-hour soak (bench/soak.py): steady load while a sim worker, an API process and
# Redis are killed on a schedule, counted from the witnesses, every process's memory
# sampled; writes bench/results/soak.json and soak.svg, then renders the documents
# (whatever the soak found: it exits 1 on a job lost, written twice or run twice).
.PHONY: soak
soak: $(STAMP)
	FERRY_BENCH_MAKE="make soak" $(BIN)/python -m bench.soak --minutes 60; \
		status=$$?; $(BIN)/python -m bench.render && exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .site
