# One task runner for humans, the README and CI (.ci/run calls `make test`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kafold-installed
CONFIG ?= examples/bank/kafold.toml

.PHONY: install run test test-tools lint unit integration bench chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,daemon,registry,tracing,embedded,spark]'
	touch $(STAMP)

install: $(STAMP)

## the main job: embedded broker + PostgreSQL (unless configured), topics, the daemon on the bank example;
## BROKER=kafka runs it on Apache Kafka (NODES=3: a three-node cluster)
run: install
	$(BIN)/kafold run -c $(CONFIG) $(if $(BROKER),--broker $(BROKER)) $(if $(NODES),--nodes $(NODES))

## mypy and import-linter resolve modules by folders, so they check a copy of the tree as it installs (kafold/ with daemon/,
## connectors/, spark_jobs/ and migrations/ inside, as pyproject's package-dir maps them)
TYPECHECK := build/typecheck
lint: install
	$(BIN)/ruff check .
	rm -rf $(TYPECHECK)/kafold && mkdir -p $(TYPECHECK)
	cp -R kafold $(TYPECHECK)/kafold
	for d in daemon connectors spark_jobs migrations; do cp -R $$d $(TYPECHECK)/kafold/$$d; done
	cd $(TYPECHECK) && $(abspath $(BIN))/mypy --config-file $(abspath pyproject.toml)
	cd $(TYPECHECK) && PYTHONPATH=. $(abspath $(BIN))/lint-imports --config $(abspath pyproject.toml)

## the unit tests; the integration tests on Apache Kafka (one broker for the session, fetched once with Maven: needs
## Java 17+ and mvn); then what concerns the embedded default (its dev stack, `make run`) on tansu
## Each stage prints its ten slowest tests and its time (what to make faster when CI grows).
STAGE = start=$$(date +%s); $(2) || exit $$?; echo "stage $(1): $$(( $$(date +%s) - start )) s"
## Debian tools the deploy and status-page tests check with (systemd-analyze, promtool, python3-seccomp, headless
## chromium): installed when missing where we are root with apt-get (a fresh machine), else those tests skip and say so
DEB_TEST_TOOLS := systemd prometheus python3-seccomp chromium
test-tools:
	@missing=$$(for p in $(DEB_TEST_TOOLS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing) \
	  >/dev/null || echo "could not install $$missing: their deploy tests skip"; fi

## The Apache Kafka stage runs in WORKERS pytest-xdist processes, each with its own session broker and PostgreSQL (a
## test pausing or killing them disturbs its own worker only); the `slow` fault-injection tests form one group that
## one worker runs in turn, a module's tests sharing a module fixture another (tests/support/xdist_groups.py).
## The unit stage runs in WORKERS processes too. WORKERS=0 runs each stage in this one process, as before.
WORKERS ?= 2
test: lint test-tools
	@$(call STAGE,unit,$(BIN)/python -m pytest --durations=10 -n $(WORKERS) -m "not integration and not tansu")
	@$(call STAGE,apache-kafka,KAFOLD_TEST_BROKER=kafka $(BIN)/python -m pytest --durations=10 -n $(WORKERS) --dist loadgroup -m "integration and not tansu")
	@$(call STAGE,tansu,KAFOLD_TEST_BROKER=tansu $(BIN)/python -m pytest --durations=10 -m tansu)

## the long chaos soak (30 minutes, >= 200 faults, >= 1M events; figures in docs/reliability.md); BROKER=kafka runs
## it on a three-node Apache Kafka cluster with broker faults besides
chaos: install
	$(BIN)/python -m tests.chaos.run_chaos $(if $(BROKER),--broker $(BROKER)) $(CHAOS_ARGS)

unit: install
	$(BIN)/python -m pytest -m "not integration and not tansu"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
