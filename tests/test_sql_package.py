"""Packaging facts: the extension installs and uninstalls cleanly, its interface is
exactly SPEC §2, the version is the same everywhere, META.json is valid PGXN
metadata, the install script is what `make script` generates, the SQL runs on
PostgreSQL 13, and released scripts never change."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

from sqlq import Conn, create, dequeue_one, problems

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = ROOT / "extension"


def control_value(key: str) -> str:
    text = (EXTENSION / "fairq.control").read_text()
    match = re.search(rf"^\s*{key}\s*=\s*'([^']*)'", text, re.MULTILINE)
    assert match, f"{key} missing from fairq.control"
    return match.group(1)


def meta() -> dict[str, object]:
    return json.loads((ROOT / "META.json").read_text())  # type: ignore[no-any-return]


# -- Install and uninstall -------------------------------------------------------------

# The schema itself is not listed: fairq.control names it (`schema = fairq`), so
# PostgreSQL's CREATE EXTENSION creates it before the script runs and, as for every
# extension that names its schema, DROP EXTENSION leaves it (empty) behind.
FAIRQ_OBJECTS = """
    SELECT 'function', p.oid::regprocedure::text FROM pg_proc p
      JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname LIKE '%fairq%'
    UNION ALL
    SELECT 'relation', c.oid::regclass::text FROM pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname LIKE '%fairq%'
    UNION ALL
    SELECT 'type', t.oid::regtype::text FROM pg_type t
      JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname LIKE '%fairq%'
    UNION ALL
    SELECT 'extension', e.extname FROM pg_extension e WHERE e.extname = 'fairq'
"""


def test_drop_extension_leaves_nothing_behind(conn: Conn) -> None:
    create(conn, "a")  # with data in the queue
    assert dequeue_one(conn) is not None
    create(conn, "b")
    conn.execute("DROP EXTENSION fairq")
    assert conn.execute(FAIRQ_OBJECTS).fetchall() == []
    conn.execute("DROP SCHEMA fairq")  # RESTRICT: fails if anything were left inside


def test_extension_can_be_dropped_and_created_again(conn: Conn) -> None:
    create(conn, "a")
    conn.execute("DROP EXTENSION fairq")
    conn.execute("CREATE EXTENSION fairq")
    assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'fairq'"
                        ).fetchone() == (control_value("default_version"),)
    assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)
    create(conn, "a", b"again")
    d = dequeue_one(conn)
    assert d is not None and d.content == b"again"
    assert problems(conn) == []


# -- The interface is exactly SPEC §2 ---------------------------------------------------

# Transcribed from SPEC §2 (revision 2): (arguments, result). history_prune's result is
# not specified.
SPEC_SIGNATURES: dict[str, tuple[str, str | None]] = {
    "queue_pause": ("p_queue text, p_until timestamptz DEFAULT 'infinity'", "void"),
    "queue_resume": ("p_queue text", "boolean"),
    "channel_set": ("p_channel text, p_max_concurrency int DEFAULT NULL, p_release_interval_ms"
                    " bigint DEFAULT 0, p_max_size int DEFAULT NULL, p_max_attempts int DEFAULT"
                    " NULL, p_weight int DEFAULT 1, p_queue text DEFAULT 'default'", "void"),
    "channel_clear": ("p_channel text, p_queue text DEFAULT 'default'", "boolean"),
    "channel_pause": ("p_channel text, p_until timestamptz DEFAULT 'infinity',"
                      " p_queue text DEFAULT 'default'", "void"),
    "channel_resume": ("p_channel text, p_queue text DEFAULT 'default'", "boolean"),
    "message_create": ("p_channel text, p_content bytea, p_dequeue_at timestamptz DEFAULT NULL,"
                       " p_priority int DEFAULT 0, p_dedup_key text DEFAULT NULL,"
                       " p_queue text DEFAULT 'default'",
                       "TABLE(id bigint, status text)"),
    "message_create_batch": ("p_channels text[], p_contents bytea[], p_dequeue_ats timestamptz[]"
                             " DEFAULT NULL, p_priorities int[] DEFAULT NULL, p_dedup_keys text[]"
                             " DEFAULT NULL, p_queue text DEFAULT 'default'",
                             "TABLE(ord int, id bigint, status text)"),
    "message_dequeue": ("p_lock_ms bigint, p_max_messages int DEFAULT 1,"
                        " p_queue text DEFAULT 'default'",
                        "TABLE(id bigint, channel text, content bytea, state bytea, num_attempts"
                        " bigint, priority int, dequeue_at timestamptz, recovered boolean)"),
    "message_complete": ("p_id bigint, p_num_attempts bigint", "text"),
    "message_complete_batch": ("p_ids bigint[], p_num_attempts bigint[]",
                               "TABLE(id bigint, status text)"),
    "message_defer": ("p_id bigint, p_num_attempts bigint, p_dequeue_at timestamptz DEFAULT NULL,"
                      " p_state bytea DEFAULT NULL", "text"),
    "message_heartbeat": ("p_id bigint, p_num_attempts bigint, p_lock_ms bigint", "text"),
    "message_fail": ("p_id bigint, p_num_attempts bigint, p_error text DEFAULT NULL", "text"),
    "message_cancel": ("p_id bigint", "text"),
    "dead_letter_retry": ("p_id bigint", "text"),
    "dead_letter_delete": ("p_id bigint", "text"),
    "dead_letter_purge": ("p_before timestamptz, p_queue text DEFAULT NULL", "bigint"),
    "history_prune": ("p_before timestamptz", None),
}

SPEC_COLUMNS = {
    "fairq.queues": ["queue", "channels", "size", "ready", "scheduled", "in_flight", "dead",
                     "paused_until"],
    "fairq.channels": ["queue", "channel", "max_concurrency", "release_interval_ms", "max_size",
                       "max_attempts", "weight", "paused_until", "size", "ready", "scheduled",
                       "in_flight", "next_dequeue_at"],
    "fairq.dead_letters": ["id", "queue", "channel", "content", "state", "num_attempts", "error",
                           "created_at", "died_at"],
    "fairq.message_history": ["id", "queue", "channel", "priority", "created_at",
                              "first_dequeued_at", "settled_at", "num_attempts", "outcome"],
}


def canonical_type(conn: Conn, name: str) -> str:
    row = conn.execute("SELECT %s::regtype::text", (name.strip(),)).fetchone()
    assert row is not None
    return str(row[0])


def parse_arguments(conn: Conn, text: str) -> list[tuple[str, str, str | None]]:
    """'p_a int DEFAULT NULL::integer, ...' -> [('p_a', 'integer', 'NULL'), ...]."""
    out: list[tuple[str, str, str | None]] = []
    for arg in filter(None, (a.strip() for a in text.split(","))):
        declaration, _, default = arg.partition(" DEFAULT ")
        name, _, type_ = declaration.partition(" ")
        # The catalog spells a typed default as 'NULL::integer': the cast is the type.
        value = re.sub(r"::[\w .\[\]]+$", "", default) if default else None
        out.append((name, canonical_type(conn, type_), value))
    return out


def parse_result(conn: Conn, text: str) -> str | list[tuple[str, str]]:
    match = re.fullmatch(r"TABLE\((.*)\)", text)
    if not match:
        return canonical_type(conn, text)
    return [(name, type_) for name, type_, _ in parse_arguments(conn, match.group(1))]


@pytest.mark.parametrize("function", SPEC_SIGNATURES)
def test_function_has_exactly_the_spec_signature(conn: Conn, function: str) -> None:
    rows = conn.execute(
        "SELECT pg_get_function_arguments(p.oid), pg_get_function_result(p.oid) FROM pg_proc p"
        " WHERE p.pronamespace = 'fairq'::regnamespace AND p.proname = %s", (function,)).fetchall()
    assert len(rows) == 1, f"fairq.{function}: {len(rows)} definitions (overloads?)"
    arguments, result = rows[0]
    spec_arguments, spec_result = SPEC_SIGNATURES[function]
    assert parse_arguments(conn, arguments) == parse_arguments(conn, spec_arguments)
    if spec_result is not None:
        assert parse_result(conn, result) == parse_result(conn, spec_result)


def test_grant_functions_take_one_role(conn: Conn) -> None:
    """SPEC names them fairq.grant_*(role) without spelling out a type."""
    rows = conn.execute(
        "SELECT p.proname, p.proargtypes::regtype[]::text[] FROM pg_proc p"
        " WHERE p.pronamespace = 'fairq'::regnamespace AND p.proname LIKE 'grant\\_%'"
        "   AND p.proname <> 'grant_to' ORDER BY 1").fetchall()
    assert [name for name, _ in rows] == ["grant_observer", "grant_operator", "grant_producer",
                                          "grant_worker"]
    for name, types in rows:
        assert len(types) == 1 and types[0] in ("regrole", "name", "text"), (name, types)


@pytest.mark.parametrize("relation", SPEC_COLUMNS)
def test_relation_has_exactly_the_spec_columns_in_order(conn: Conn, relation: str) -> None:
    columns = [r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass"
        " AND attnum > 0 AND NOT attisdropped ORDER BY attnum", (relation,))]
    assert columns == SPEC_COLUMNS[relation]


def test_message_history_is_a_table(conn: Conn) -> None:
    assert conn.execute("SELECT relkind FROM pg_class WHERE oid = 'fairq.message_history'::regclass"
                        ).fetchone() == ("r",)


# -- Versions and metadata --------------------------------------------------------------


def test_versions_agree() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        pyproject = tomllib.load(f)
    m = meta()
    provides = m["provides"]
    assert isinstance(provides, dict)
    versions = {
        "fairq.control default_version": control_value("default_version"),
        "META.json version": m["version"],
        "META.json provides.fairq.version": provides["fairq"]["version"],
        "pyproject.toml version": pyproject["project"]["version"],
    }
    assert len(set(versions.values())) == 1, versions
    assert (EXTENSION / f"fairq--{versions['META.json version']}.sql").is_file()


# The license strings that PGXN Meta Spec 1.0.0 defines.
PGXN_LICENSES = {
    "agpl_3", "apache_1_1", "apache_2_0", "artistic_1", "artistic_2", "bsd", "freebsd",
    "gfdl_1_2", "gfdl_1_3", "gpl_1", "gpl_2", "gpl_3", "lgpl_2_1", "lgpl_3_0", "mit",
    "mozilla_1_0", "mozilla_1_1", "openssl", "perl_5", "postgresql", "qpl_1_0", "ssleay",
    "sun", "zlib", "open_source", "restricted", "unrestricted", "unknown",
}
SEMVER = re.compile(r"\d+\.\d+\.\d+(?:-[0-9A-Za-z-]+)?")


def test_meta_json_has_the_pgxn_required_keys() -> None:
    m = meta()
    missing = {"name", "abstract", "version", "maintainer", "license", "provides",
               "meta-spec"} - m.keys()
    assert missing == set()
    assert m["name"] == "fairq"
    assert isinstance(m["abstract"], str) and m["abstract"]
    assert isinstance(m["version"], str) and SEMVER.fullmatch(m["version"])
    maintainer = m["maintainer"]
    assert (isinstance(maintainer, str) and maintainer) or (
        isinstance(maintainer, list) and maintainer and all(isinstance(x, str) for x in maintainer))
    license_ = m["license"]
    assert license_ in PGXN_LICENSES or (isinstance(license_, dict) and license_) or (
        isinstance(license_, list) and set(license_) <= PGXN_LICENSES)
    assert m["meta-spec"] == {"version": "1.0.0", "url": "https://pgxn.org/meta/spec.txt"} or (
        isinstance(m["meta-spec"], dict) and m["meta-spec"].get("version") == "1.0.0")
    provides = m["provides"]
    assert isinstance(provides, dict) and "fairq" in provides
    for extension, entry in provides.items():
        assert {"file", "version"} <= entry.keys(), extension
        assert SEMVER.fullmatch(entry["version"]), extension


def test_files_named_by_meta_json_exist() -> None:
    provides = meta()["provides"]
    assert isinstance(provides, dict)
    assert provides["fairq"]["file"] == f"extension/fairq--{control_value('default_version')}.sql"
    for entry in provides.values():
        for key in ("file", "docfile"):
            if key in entry:
                assert (ROOT / entry[key]).is_file(), f"{key} {entry[key]} does not exist"


# -- The install script is generated from sql/ -------------------------------------------


def test_install_script_is_what_make_script_generates(tmp_path: Path) -> None:
    for part in ("sql", "extension"):
        shutil.copytree(ROOT / part, tmp_path / part)
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    script = f"extension/fairq--{control_value('default_version')}.sql"
    (tmp_path / script).unlink()
    subprocess.run(["make", "-s", "script"], cwd=tmp_path, check=True, capture_output=True)
    generated = (tmp_path / script).read_text()
    committed = (ROOT / script).read_text()
    assert generated == committed, "run `make script` and commit the result"
    # ... and every file of sql/ went into it.
    for source in sorted((ROOT / "sql").glob("*.sql")):
        assert f"-- ==== sql/{source.name} ====" in committed, source.name


# -- Nothing newer than PostgreSQL 13 ------------------------------------------------------

# Syntax and functions that PostgreSQL 13 does not have: the SQL stays portable to 13,
# although META.json requires only what CI runs (15, 16, 18; see .ci/run).
NEWER_THAN_13 = {
    r"(?<![\w$.])\d+(?:_\d+)+\b": "numeric literal with underscores (PostgreSQL 16)",
    r"\bMERGE\s+INTO\b": "MERGE (PostgreSQL 15)",
    r"\bCREATE\s+OR\s+REPLACE\s+TRIGGER\b": "CREATE OR REPLACE TRIGGER (PostgreSQL 14)",
    r"\bNULLS\s+NOT\s+DISTINCT\b": "UNIQUE NULLS NOT DISTINCT (PostgreSQL 15)",
    r"\bBEGIN\s+ATOMIC\b": "SQL-standard function body (PostgreSQL 14)",
    r"\bRETURNS\b[^;$]*?\bLANGUAGE\s+sql\b[^;$]*?\bRETURN\b": "SQL-standard RETURN body (14)",
    r"\bsecurity_invoker\b": "security_invoker views (PostgreSQL 15)",
    r"\bSEARCH\s+(?:DEPTH|BREADTH)\s+FIRST\s+BY\b": "recursive SEARCH clause (PostgreSQL 14)",
    r"\bCYCLE\s+\w+(?:\s*,\s*\w+)*\s+SET\b": "recursive CYCLE clause (PostgreSQL 14)",
    r"\bON\s+PARAMETER\b": "GRANT ON PARAMETER (PostgreSQL 15)",
    r"\bpg_(?:database_owner|read_all_data|write_all_data|checkpoint|maintain)\b":
        "predefined role newer than 13",
    r"@extschema:\w+@": "@extschema:name@ (PostgreSQL 16)",
    r"\bIS\s+(?:NOT\s+)?JSON\b": "IS JSON (PostgreSQL 16)",
    r"\bJSON_(?:TABLE|QUERY|VALUE|EXISTS|SCALAR|SERIALIZE)\s*\(": "SQL/JSON function (16/17)",
    r"\bSYSTEM_USER\b": "SYSTEM_USER (PostgreSQL 16)",
    r"\bWITHOUT\s+OVERLAPS\b": "WITHOUT OVERLAPS (PostgreSQL 17)",
    r"\bSET\s+ACCESS\s+METHOD\b": "SET ACCESS METHOD (PostgreSQL 15)",
    r"\b\w*multirange\b": "multirange types (PostgreSQL 14)",
    r"\b(?:string_to_table|trim_array|date_bin|bit_count|range_agg|unistr|regexp_count"
    r"|regexp_instr|regexp_like|regexp_substr|any_value|random_normal|array_sample"
    r"|array_shuffle|pg_input_is_valid|pg_input_error_info|erf|erfc|array_reverse"
    r"|array_sort|uuidv7|uuid_extract_version|uuid_extract_timestamp)\s*\(":
        "function newer than PostgreSQL 13",
}


def sql_files() -> list[Path]:
    return sorted((ROOT / "sql").glob("*.sql")) + sorted(EXTENSION.glob("fairq--*.sql"))


def without_comments(text: str) -> str:
    return re.sub(r"--[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL))


@pytest.mark.parametrize("path", sql_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_sql_uses_nothing_newer_than_postgresql_13(path: Path) -> None:
    text = without_comments(path.read_text())
    found = [f"{why}: {m.group(0)!r}" for pattern, why in NEWER_THAN_13.items()
             for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert found == []


def test_control_file_uses_nothing_newer_than_postgresql_13() -> None:
    keys = {line.split("=")[0].strip() for line in
            (EXTENSION / "fairq.control").read_text().splitlines()
            if "=" in line and not line.lstrip().startswith("#")}
    assert keys <= {"comment", "default_version", "module_pathname", "schema", "relocatable",
                    "superuser", "trusted", "requires", "encoding", "directory"}, keys


def test_meta_json_requires_the_oldest_postgresql_ci_tests() -> None:
    prereqs = meta()["prereqs"]
    assert isinstance(prereqs, dict)
    assert prereqs["runtime"]["requires"]["PostgreSQL"] == "15.0.0"


# -- Released scripts are frozen --------------------------------------------------------


def test_released_scripts_keep_their_recorded_sha256() -> None:
    sums = EXTENSION / "SHA256SUMS"
    assert sums.exists(), "extension/SHA256SUMS must list every released install script"
    lines = [line for line in sums.read_text().splitlines() if line.strip()]
    assert lines, "SHA256SUMS is empty"
    for line in lines:
        match = re.fullmatch(r"([0-9a-f]{64}) [ *](\S+)", line)
        assert match, f"not a sha256sum line: {line!r}"
        digest, name = match.groups()
        path = EXTENSION / name
        assert path.is_file(), f"{name} is listed in SHA256SUMS but missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, (
            f"{name} changed after its release: ship the change as a new version")


def test_every_script_of_an_earlier_version_is_recorded_as_released() -> None:
    """Only the version under development may still change: a script of an earlier
    one missing from SHA256SUMS would be unfrozen, and its version left out of the
    upgrade tests."""
    listed = {line.split()[-1].lstrip("*") for line in
              (EXTENSION / "SHA256SUMS").read_text().splitlines() if line.strip()}
    current = re.search(r"default_version\s*=\s*'([^']+)'",
                        (EXTENSION / "fairq.control").read_text())
    assert current
    unlisted = [p.name for p in EXTENSION.glob("fairq--*.sql") if p.name not in listed
                and not p.name.endswith(f"{current.group(1)}.sql")]
    assert unlisted == []
