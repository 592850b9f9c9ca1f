"""``fairq doctor``: what in a database keeps fairq from running well, found by reading
catalogs and statistics (nothing is changed).

Each check gives a :class:`Finding`. The checks are the things that quietly slow or
break a PostgreSQL queue in production: an installed version behind the package, a
transaction or replication slot that keeps vacuum from removing served messages (every
dequeue then walks their index entries), autovacuum off, too slow or behind on
fairq's tables, fairq's objects granted to PUBLIC, a ``max_attempts`` on the
periodic schedules' channel (their drivers die), and (with ``invariants``)
``fairq.check()``'s inconsistencies between counters, turns and messages.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from fairq import __version__
from fairq.install import _version_key, extension_version, installed_version
from fairq.periodic import PERIODIC_CHANNEL

__all__ = ["Finding", "Verdict", "diagnose"]

#: docs/operations.md recommends this naptime: autovacuum visits a table at most once
#: per naptime, and dead entries of served messages and channels pile up in between.
RECOMMENDED_NAPTIME = timedelta(seconds=10)

#: A table with more dead rows than twice its autovacuum threshold, and this many at
#: least, whose last vacuum is older than STALE_VACUUM is one autovacuum does not keep
#: up with (or cannot clean).
DEAD_ROWS_WORTH_A_LOOK = 10_000
STALE_VACUUM = timedelta(minutes=10)


class Verdict(enum.Enum):
    OK = "ok"
    WARNING = "warning"  # works, but slower or riskier than it should be
    PROBLEM = "problem"  # broken or unsafe: `fairq doctor` exits 1


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: Verdict
    detail: str


def _version(conn: psycopg.Connection[Any]) -> Finding:
    extension = extension_version(conn)
    how, version = ("extension", extension) if extension else ("plain install",
                                                               installed_version(conn))
    if version is None:
        return Finding("version", Verdict.PROBLEM,
                       "fairq is not installed here (CREATE EXTENSION fairq, or fairq install)")
    installed, package = _version_key(version), _version_key(__version__)
    if installed is not None and package is not None and installed < package:
        upgrade = ("ALTER EXTENSION fairq UPDATE" if how == "extension" else "fairq upgrade")
        return Finding("version", Verdict.WARNING,
                       f"{how} {version} is behind this package's {__version__}: {upgrade}")
    return Finding("version", Verdict.OK, f"{how} {version}")


def _setting(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute("SELECT current_setting(%s)", [name]).fetchone()
    assert row is not None
    return str(row[0])


def _autovacuum(conn: psycopg.Connection[Any]) -> list[Finding]:
    off = [name for name in ("autovacuum", "track_counts") if _setting(conn, name) != "on"]
    if off:
        return [Finding("autovacuum", Verdict.PROBLEM,
                        f"{' and '.join(off)} off: dead rows of served messages are never"
                        " removed, and every dequeue walks more of them")]
    row = conn.execute("SELECT setting::int FROM pg_settings WHERE name = 'autovacuum_naptime'"
                       ).fetchone()
    naptime = timedelta(seconds=int(row[0]) if row else 60)
    if naptime > RECOMMENDED_NAPTIME:
        return [Finding("autovacuum", Verdict.WARNING,
                        f"autovacuum_naptime is {naptime.total_seconds():g} s: dequeues walk"
                        " the index entries of everything served since the last visit;"
                        f" {RECOMMENDED_NAPTIME.total_seconds():g} s is recommended"
                        " (docs/operations.md)")]
    return [Finding("autovacuum", Verdict.OK,
                    f"on, autovacuum_naptime {naptime.total_seconds():g} s")]


def _oldest_snapshot(conn: psycopg.Connection[Any], max_age: timedelta) -> list[Finding]:
    """Whatever holds back the horizon that vacuum may clean fairq's tables up to:
    this database's open transactions, its prepared ones, and replication slots that
    no one reads. (Sessions of other databases hold back only shared catalogs.)"""
    findings = []
    # A session this role may not see shows its database and snapshot but neither its
    # start nor its type (its query reads '<insufficient privilege>').
    seen = conn.execute(
        "SELECT count(*) FILTER (WHERE query = '<insufficient privilege>'"
        "                          AND usesysid IS NOT NULL),"
        "       max(clock_timestamp() - xact_start) FILTER (WHERE backend_xmin IS NOT NULL"
        "           OR backend_xid IS NOT NULL),"
        "       (array_agg(pid ORDER BY xact_start) FILTER (WHERE xact_start IS NOT NULL"
        "           AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)))[1]"
        "  FROM pg_stat_activity"
        " WHERE pid <> pg_backend_pid() AND datname = current_database()").fetchone()
    assert seen is not None
    hidden, age, pid = seen
    if age is not None and age > max_age:
        findings.append(Finding(
            "oldest transaction", Verdict.WARNING,
            f"backend {pid} has held a snapshot for {_duration(age)}: no row deleted since"
            " can be vacuumed away, so fairq's tables and indexes grow and dequeues slow"))
    prepared = conn.execute("SELECT gid, clock_timestamp() - prepared FROM pg_prepared_xacts"
                            " WHERE database = current_database()"
                            " ORDER BY prepared LIMIT 1").fetchone()
    if prepared is not None and prepared[1] > max_age:
        findings.append(Finding(
            "oldest transaction", Verdict.WARNING,
            f"prepared transaction {prepared[0]!r} is {_duration(prepared[1])} old and holds"
            " back vacuum (COMMIT PREPARED or ROLLBACK PREPARED it)"))
    slots = conn.execute("SELECT string_agg(slot_name, ', ') FROM pg_replication_slots"
                         " WHERE NOT active AND xmin IS NOT NULL").fetchone()
    if slots is not None and slots[0] is not None:
        findings.append(Finding(
            "oldest transaction", Verdict.WARNING,
            f"inactive replication slots hold back vacuum: {slots[0]}"))
    if hidden:
        findings.append(Finding(
            "oldest transaction", Verdict.WARNING,
            f"{hidden} sessions of this database are hidden from this role: grant it"
            " pg_read_all_stats to see whether one holds back vacuum"))
    return findings or [Finding("oldest transaction", Verdict.OK,
                                f"no snapshot older than {_duration(max_age)}")]


def _tables(conn: psycopg.Connection[Any]) -> list[Finding]:
    # A table's autovacuum threshold, from its own settings (docs/operations.md) or the
    # server's: vacuum is due past it, so twice as many dead rows with no vacuum for
    # STALE_VACUUM means it does not come, or cannot clean.
    rows = conn.execute(
        "WITH t AS ("
        " SELECT s.relname, s.n_dead_tup,"
        "        clock_timestamp() - greatest(s.last_autovacuum, s.last_vacuum) AS since,"
        "        coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold')::float8)"
        "        + coalesce(o.scale, current_setting('autovacuum_vacuum_scale_factor')::float8)"
        "          * greatest(c.reltuples, 0) AS due_at"
        "   FROM pg_stat_all_tables s JOIN pg_class c ON c.oid = s.relid"
        "  CROSS JOIN LATERAL (SELECT"
        "        max(option_value::float8) FILTER"
        "            (WHERE option_name = 'autovacuum_vacuum_threshold') AS threshold,"
        "        max(option_value::float8) FILTER"
        "            (WHERE option_name = 'autovacuum_vacuum_scale_factor') AS scale"
        "        FROM pg_options_to_table(c.reloptions)) o"
        "  WHERE s.schemaname = 'fairq')"
        " SELECT relname, n_dead_tup, since FROM t"
        "  WHERE n_dead_tup > greatest(2 * due_at, %s) AND coalesce(since > %s, true)"
        "  ORDER BY n_dead_tup DESC", [DEAD_ROWS_WORTH_A_LOOK, STALE_VACUUM]).fetchall()
    return [Finding(f"table fairq.{name}", Verdict.WARNING,
                    f"{dead:,} dead rows and " + ("never vacuumed" if since is None
                                                  else f"last vacuumed {_duration(since)} ago")
                    + ": autovacuum is not keeping up (see the oldest transaction, and"
                    " docs/operations.md on table health)")
            for name, dead, since in rows] or [
        Finding("tables", Verdict.OK, "autovacuum keeps up with fairq's tables")]


def _public_grants(conn: psycopg.Connection[Any]) -> Finding:
    # (A NULL ACL is the default one: EXECUTE for PUBLIC on a function, USAGE on a type.)
    rows = conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p,"
        "       aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a"
        " WHERE p.pronamespace = 'fairq'::regnamespace AND a.grantee = 0"
        " UNION ALL"
        " SELECT c.oid::regclass::text FROM pg_class c, aclexplode(c.relacl) a"
        " WHERE c.relnamespace = 'fairq'::regnamespace AND a.grantee = 0"
        " UNION ALL"
        " SELECT c.oid::regclass::text || '.' || quote_ident(t.attname)"
        "  FROM pg_class c JOIN pg_attribute t ON t.attrelid = c.oid, aclexplode(t.attacl) a"
        " WHERE c.relnamespace = 'fairq'::regnamespace AND a.grantee = 0"
        " UNION ALL"
        " SELECT 'type ' || t.oid::regtype::text FROM pg_type t"
        "  LEFT JOIN pg_class r ON r.oid = t.typrelid,"
        "       aclexplode(coalesce(t.typacl, acldefault('T', t.typowner))) a"
        " WHERE t.typnamespace = 'fairq'::regnamespace AND a.grantee = 0"
        "   AND t.typelem = 0 AND (r.oid IS NULL OR r.relkind = 'c')"
        " UNION ALL"
        " SELECT 'schema ' || n.nspname FROM pg_namespace n, aclexplode(n.nspacl) a"
        " WHERE n.nspname = 'fairq' AND a.grantee = 0"
        ).fetchall()
    if rows:
        names = sorted(r[0] for r in rows)
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return Finding("privileges", Verdict.PROBLEM,
                       f"granted to PUBLIC: {', '.join(names[:5])}{more}; revoke that, and"
                       " give roles what they need with fairq.grant_producer, grant_worker"
                       " or grant_observer")
    return Finding("privileges", Verdict.OK, "nothing of fairq's is granted to PUBLIC")


def _periodic_drivers(conn: psycopg.Connection[Any]) -> list[Finding]:
    # A driver's num_attempts grows by one a tick (fairq.periodic): with max_attempts on
    # its channel it dies after that many ticks, its schedule falls silent, and a
    # driver put back from the dead letters has lost its name (a retry drops the dedup
    # key), so the next schedule_periodic makes a second driver beside it.
    rows = conn.execute("SELECT queue, quote_literal(queue), max_attempts FROM fairq.channels"
                        " WHERE channel = %s AND max_attempts IS NOT NULL ORDER BY queue",
                        [PERIODIC_CHANNEL]).fetchall()
    return [Finding(f"periodic schedules, queue {queue}", Verdict.PROBLEM,
                    f"channel {PERIODIC_CHANNEL} has max_attempts {attempts}: each schedule's"
                    f" driver dies after {attempts} ticks; set its policy again without"
                    f" p_max_attempts, or SELECT fairq.channel_clear('{PERIODIC_CHANNEL}',"
                    f" {literal})")
            for queue, literal, attempts in rows] or [
        Finding("periodic schedules", Verdict.OK, f"{PERIODIC_CHANNEL} has no max_attempts")]


def _invariants(conn: psycopg.Connection[Any]) -> list[Finding]:
    rows = conn.execute("SELECT channel, problem FROM fairq.check()").fetchall()
    return [Finding(f"invariant, channel {channel}", Verdict.PROBLEM, problem)
            for channel, problem in rows] or [
        Finding("invariants", Verdict.OK, "fairq.check() found nothing wrong")]


def _duration(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


#: What a check that a role may not run needs, said in its finding. The version is
#: refused only on a plain install (pg_extension is readable by all); the checks not
#: named read catalogs and statistics views, every role's unless SELECT was revoked.
_NEEDS = {
    "version": "a plain install's version is in fairq.installed_version, which only the"
               " owner of schema fairq may read: run the doctor as that owner",
    "invariants": "fairq.check() needs fairq.grant_observer"
                  " (SELECT fairq.grant_observer({role}) as the owner of fairq)",
    "periodic schedules": "reading fairq.channels needs fairq.grant_observer"
                          " (SELECT fairq.grant_observer({role}) as the owner of fairq)",
}
_CATALOGS = ("the check reads system catalogs and statistics views: grant the role SELECT"
             " on that one")


def _denied(conn: psycopg.Connection[Any], check: str,
            error: psycopg.errors.InsufficientPrivilege) -> Finding:
    row = conn.execute("SELECT current_user, quote_literal(quote_ident(current_user))"
                       ).fetchone()
    assert row is not None
    role, literal = row
    needs = _NEEDS.get(check, _CATALOGS).format(role=literal)
    return Finding(check, Verdict.PROBLEM,
                   f"could not run as {role}: {error.diag.message_primary}; {needs}")


def _attempt(conn: psycopg.Connection[Any], check: str,
             run: Callable[[], list[Finding]]) -> tuple[list[Finding], bool]:
    """``run``'s findings and True, or, when the role lacks a privilege it needs, a
    finding that says so and False. Each check runs in a transaction of its own (a
    savepoint in the caller's): after an error the transaction is aborted, and every
    check after it failed too."""
    try:
        with conn.transaction():
            return run(), True
    except psycopg.errors.InsufficientPrivilege as error:
        return [_denied(conn, check, error)], False


def diagnose(conn: psycopg.Connection[Any], *, invariants: bool = False,
             max_transaction_age: timedelta = timedelta(minutes=5)) -> list[Finding]:
    """The findings on ``conn``'s database, in the order above. ``invariants`` also runs
    ``fairq.check()``, which reads every message (a role given fairq.grant_observer
    may; minutes on a table of millions). A snapshot older than
    ``max_transaction_age`` is reported. A check the role may not run is a problem of
    its own, which says what it needs, and the others still run."""
    findings, ran = _attempt(conn, "version", lambda: [_version(conn)])
    if ran and findings[0].verdict is Verdict.PROBLEM:
        return findings  # not installed: there is no schema fairq for the others to read
    checks: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("autovacuum", lambda: _autovacuum(conn)),
        ("oldest transaction", lambda: _oldest_snapshot(conn, max_transaction_age)),
        ("tables", lambda: _tables(conn)),
        ("privileges", lambda: [_public_grants(conn)]),
        ("periodic schedules", lambda: _periodic_drivers(conn)),
    ]
    if invariants:
        checks.append(("invariants", lambda: _invariants(conn)))
    for check, run in checks:
        findings += _attempt(conn, check, run)[0]
    return findings
