"""``fairq install`` / ``fairq upgrade``: the extension's SQL as a plain schema.

For databases where ``CREATE EXTENSION`` of a custom extension is impossible
(managed services), the very scripts the extension ships are run as they are: the
install script of the current version, then the upgrade scripts ``fairq--A--B.sql``
in the order PostgreSQL itself would follow. Only the ``\\echo ... \\quit`` guard
(which stops psql from running a script by accident) is removed. The installed
version is kept in ``fairq.installed_version``, created here, since there is no
``pg_extension`` row to hold it.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql

__all__ = ["InstallError", "Scripts", "extension_version", "install", "installed_version",
           "upgrade"]

_GUARD = re.compile(r"^\\echo .*\\quit\s*$", re.MULTILINE)
_UPGRADE = re.compile(r"^fairq--(?P<source>[^-]+)--(?P<target>[^-]+)\.sql$")
Connection = psycopg.Connection[Any]


class InstallError(Exception):
    """The database is not in a state this command can act on; nothing was changed."""


def _version_key(version: str) -> tuple[int, ...] | None:
    """major.minor.patch as numbers; None for what is not one (a hand-made build)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return None if match is None else tuple(int(part) for part in match.groups())


def _read(path: Path) -> str:
    """The text of one of the scripts' files: one that cannot be read (a mistyped
    --scripts) is an InstallError, as a refusal is, rather than a traceback."""
    try:
        return path.read_text()
    except OSError as exc:
        raise InstallError(f"cannot read {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class Scripts:
    """A directory laid out like the extension's: ``fairq.control`` and scripts."""

    directory: Path

    @classmethod
    def bundled(cls) -> Scripts:
        """The scripts inside the wheel, or the repository's extension/ in a checkout."""
        packaged = Path(__file__).parent / "extension"
        if packaged.is_dir():
            return cls(packaged)
        return cls(Path(__file__).resolve().parents[2] / "extension")

    @property
    def default_version(self) -> str:
        control = _read(self.directory / "fairq.control")
        found = re.search(r"^default_version\s*=\s*'([^']+)'", control, re.MULTILINE)
        if found is None:
            raise InstallError(f"no default_version in {self.directory / 'fairq.control'}")
        return found.group(1)

    def install_script(self, version: str) -> Path:
        return self.directory / f"fairq--{version}.sql"

    def upgrade_path(self, source: str, target: str) -> list[Path]:
        """The shortest chain of upgrade scripts from ``source`` to ``target``."""
        steps: dict[str, list[tuple[str, Path]]] = {}
        for path in sorted(self.directory.glob("fairq--*--*.sql")):
            match = _UPGRADE.match(path.name)
            if match:
                steps.setdefault(match["source"], []).append((match["target"], path))
        paths: dict[str, list[Path]] = {source: []}
        todo = deque([source])
        while todo:
            version = todo.popleft()
            for following, script in steps.get(version, []):
                if following not in paths:
                    paths[following] = [*paths[version], script]
                    todo.append(following)
        if target not in paths:
            raise InstallError(f"no upgrade path from {source} to {target} in {self.directory}")
        return paths[target]


def _run_script(conn: Connection, path: Path) -> None:
    sql = _GUARD.sub("", _read(path)).replace("@extschema@", "fairq")
    # As CREATE EXTENSION runs a script: function bodies are not checked as they are
    # created (an SQL function may call one the script creates after it), and names
    # resolve in pg_catalog first, then fairq. With the installer's search_path, an
    # operator planted in public (`=` on an enum and text) was bound into the index
    # predicates and views, and ran as the owner at every insert: any role that could
    # create objects in public became superuser. With fairq first (until 0.7.36), one
    # that fairq's owner planted in fairq (`<>` on intervals) ran in an upgrade.
    conn.execute("SET LOCAL check_function_bodies = off")
    conn.execute("SET LOCAL search_path = pg_catalog, fairq, pg_temp")
    # No parameters: psycopg sends the script as one simple query, many statements.
    conn.execute(sql.encode())


def extension_version(conn: Connection) -> str | None:
    """The version of the fairq extension in this database, or None."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'fairq'").fetchone()
    return None if row is None else str(row[0])


def installed_version(conn: Connection) -> str | None:
    """The version ``fairq install`` put in this database, or None."""
    row = conn.execute("SELECT to_regclass('fairq.installed_version') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return None
    version = conn.execute("SELECT version FROM fairq.installed_version").fetchone()
    return None if version is None else str(version[0])


def _become_owner(conn: Connection) -> None:
    """Runs the rest of the transaction as the owner of schema fairq. Run as another
    role, an upgrade made the objects it created that role's, and the owner's
    SECURITY DEFINER functions could not use them: every call failed with "permission
    denied". And a superuser running it ran whatever the owner had put in fairq."""
    row = conn.execute(
        "SELECT n.nspowner::regrole::text, current_user = n.nspowner::regrole::text,"
        " pg_has_role(current_user, n.nspowner, 'MEMBER')"
        " FROM pg_namespace n WHERE n.nspname = 'fairq'").fetchone()
    if row is None:
        return  # nothing installed: the caller says so
    owner, is_owner, may_become = row
    if is_owner:
        return
    if not may_become:
        raise InstallError(f"schema fairq belongs to role {owner}: run `fairq upgrade` as"
                           f" {owner} (or as a member of it)")
    conn.execute(psycopg.sql.SQL("SET LOCAL ROLE {}").format(psycopg.sql.Identifier(owner)))


def _keep_private(conn: Connection) -> None:
    """fairq.installed_version is the owner's alone: made after the script's revokes,
    it took the owner's default privileges (which may grant to PUBLIC), and a producer
    could rewrite it and make every upgrade fail."""
    conn.execute("REVOKE ALL ON fairq.installed_version FROM PUBLIC")


def _refuse_extension(conn: Connection) -> None:
    extension = extension_version(conn)
    if extension is not None:
        raise InstallError(f"this database has the fairq extension (version {extension}) "
                           "installed; upgrade it with ALTER EXTENSION fairq UPDATE")


def install(conn: Connection, scripts: Scripts | None = None) -> str:
    """Installs the current version as schema ``fairq``, in one transaction."""
    scripts = scripts or Scripts.bundled()
    version = scripts.default_version
    with conn.transaction():
        _refuse_extension(conn)
        existing = installed_version(conn)
        if existing is not None:
            raise InstallError(f"fairq {existing} is already installed; "
                               "use `fairq upgrade` to move to a newer version")
        if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'fairq'").fetchone():
            raise InstallError("schema fairq already exists but was not installed by fairq; "
                               "drop it or install into another database")
        conn.execute("CREATE SCHEMA fairq")
        _run_script(conn, scripts.install_script(version))
        conn.execute("""
            CREATE TABLE fairq.installed_version (
                singleton    boolean     NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
                version      text        NOT NULL,
                installed_at timestamptz NOT NULL DEFAULT now()
            )""")
        _keep_private(conn)
        conn.execute("INSERT INTO fairq.installed_version (version) VALUES (%s)", (version,))
    return version


def upgrade(conn: Connection, scripts: Scripts | None = None,
            target: str | None = None) -> list[Path]:
    """Applies the upgrade scripts up to ``target`` (default: the current version) in
    one transaction; returns the scripts run (none when already there)."""
    asked, bundled = bool(target), scripts is None
    scripts = scripts or Scripts.bundled()
    target = target or scripts.default_version
    with conn.transaction():
        _refuse_extension(conn)
        _become_owner(conn)
        if installed_version(conn) is None:
            raise InstallError("fairq is not installed in this database; run `fairq install`")
        # FOR UPDATE serialises concurrent upgrades: the second one reads the new version.
        row = conn.execute("SELECT version FROM fairq.installed_version FOR UPDATE").fetchone()
        assert row is not None
        current = str(row[0])
        installed, wanted = _version_key(current), _version_key(target)
        # Scripts only lead forward: without this, an older package (an application
        # rolled back) reported a missing upgrade path, which reads like a broken one.
        if installed is not None and wanted is not None and installed > wanted:
            refused = f"this database has fairq {current}, newer than"
            if asked:
                raise InstallError(f"{refused} {target}, the version asked for: downgrades"
                                   " are not supported")
            if bundled:
                raise InstallError(f"{refused} this package's {target}: downgrades are not"
                                   f" supported; install the fairq package {current} or later")
            raise InstallError(f"{refused} {target}, the default_version in {scripts.directory}:"
                               f" downgrades are not supported; use the scripts of {current}"
                               " or later")
        path = scripts.upgrade_path(current, target)
        for script in path:
            _run_script(conn, script)
        conn.execute("UPDATE fairq.installed_version SET version = %s, installed_at = now()",
                     (target,))
        _keep_private(conn)
    return path
