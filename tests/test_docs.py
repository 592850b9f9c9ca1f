"""The documentation says what the code does.

- Every public SQL object (SPEC §2, plus fairq.check()) carries a COMMENT ON, and
  every function a caller can run with the owner's rights is one of them.
- docs/sql-reference.md is exactly what ``python tools/docgen.py`` generates now.
- docs/python.md mentions every name the ``fairq`` package exports.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import psycopg

import fairq

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _tool(name: str) -> ModuleType:
    """A script of tools/ as a module: tools/ is no package, its scripts are run by path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docgen = _tool("docgen")

# SPEC §2, by name: the contract the reference must cover.
SPEC_FUNCTIONS = {
    "queue_pause", "queue_resume", "channel_set", "channel_clear", "channel_pause",
    "channel_resume", "message_create", "message_create_batch",
    "message_dequeue", "message_complete", "message_complete_batch", "message_defer",
    "message_heartbeat", "message_fail", "message_cancel", "dead_letter_retry",
    "dead_letter_delete", "dead_letter_purge",
    "history_prune", "grant_producer", "grant_worker", "grant_observer", "check",
}
SPEC_RELATIONS = {"queues", "channels", "dead_letters", "message_history"}
# Public beyond SPEC: what a worker calls to sleep (the doorbell, sql/events.sql), and
# the grants' counterparts (sql/privileges.sql).
BEYOND_SPEC_FUNCTIONS = {"doorbell_hold", "doorbell_quiet", "doorbell_release",
                         "revoke_producer", "revoke_worker", "revoke_observer",
                         "grant_operator", "revoke_operator"}


def test_the_generator_covers_the_spec() -> None:
    listed = {name for names in docgen.PUBLIC_FUNCTIONS.values() for name in names}
    assert listed == SPEC_FUNCTIONS | BEYOND_SPEC_FUNCTIONS
    assert {*docgen.PUBLIC_VIEWS, *docgen.PUBLIC_TABLES} == SPEC_RELATIONS


def test_every_public_sql_object_has_a_comment(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    functions = conn.execute("""
        SELECT p.proname, obj_description(p.oid, 'pg_proc'), p.prosecdef
          FROM pg_proc p WHERE p.pronamespace = 'fairq'::regnamespace""").fetchall()
    public = SPEC_FUNCTIONS | BEYOND_SPEC_FUNCTIONS
    names = {name for name, _, _ in functions}
    assert names >= public, f"missing: {public - names}"
    uncommented = sorted(name for name, comment, _ in functions
                         if name in public and not (comment or "").strip())
    assert not uncommented, f"public functions without COMMENT ON: {uncommented}"
    # A function that runs with the owner's rights is API: it must be listed (and so
    # documented) like the others.
    unlisted = sorted(name for name, _, secdef in functions if secdef and name not in public)
    assert not unlisted, f"SECURITY DEFINER functions missing from docgen.PUBLIC_FUNCTIONS: {unlisted}"

    relations = dict(conn.execute("""
        SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_class c
         WHERE c.relnamespace = 'fairq'::regnamespace AND c.relkind IN ('r', 'v')""").fetchall())
    assert relations.keys() >= SPEC_RELATIONS
    uncommented = sorted(name for name in SPEC_RELATIONS if not (relations[name] or "").strip())
    assert not uncommented, f"public views/tables without COMMENT ON: {uncommented}"


def test_sql_reference_is_what_the_generator_produces(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    committed = (DOCS / "sql-reference.md").read_text()
    assert committed == docgen.generate(conn), (
        "docs/sql-reference.md is out of date: run `python tools/docgen.py` and commit it")


def test_python_reference_mentions_every_exported_name() -> None:
    text = (DOCS / "python.md").read_text()
    missing = [name for name in fairq.__all__
               if name != "__version__" and not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not missing, f"docs/python.md does not mention: {missing}"


def test_docs_link_to_files_that_exist() -> None:
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            path = page.parent / target
            assert path.exists(), f"{page.name} links to missing {target}"
