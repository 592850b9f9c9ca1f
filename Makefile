# fairq — PGXS build of a plpgsql-only extension, plus the developer targets.
#
#   make install [PG_CONFIG=/path/to/pg_config]   install into a PostgreSQL
#   make test                                      everything CI runs
#   make demo | make bench                         see README
#
# sql/*.sql is the living source. extension/fairq--$(EXTVERSION).sql is generated
# from it (`make script`) and committed; once a version has been released its script
# never changes again (extension/SHA256SUMS, checked by the tests).

PG_CONFIG ?= pg_config
EXTVERSION := $(shell sed -n "s/^default_version = '\(.*\)'/\1/p" extension/fairq.control)
SQL_SOURCES = sql/tables.sql sql/clock.sql sql/validate.sql sql/events.sql sql/channels.sql \
              sql/create.sql sql/dequeue.sql sql/settle.sql sql/observe.sql \
              sql/privileges.sql
SCRIPT = extension/fairq--$(EXTVERSION).sql

MODULEDIR = extension
DATA = extension/fairq.control $(sort $(wildcard extension/fairq--*.sql))

PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip

.PHONY: script upgrade-script venv test lint demo bench

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

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
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

# Installs the extension into the PostgreSQL that PG_CONFIG names (needs write
# access to its share directory), then runs every default suite.
test: $(VENV)/.installed-spark install lint
	$(VENV)/bin/pytest -q tests

demo: venv install
	$(VENV)/bin/fairq demo

bench: venv install
	$(VENV)/bin/fairq bench --json bench.json --plots docs/bench
