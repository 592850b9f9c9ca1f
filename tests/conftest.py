"""Test session fixtures: one real PostgreSQL cluster, a fresh database per test.

The cluster is started by the session (see fairq.cluster) unless FAIRQ_TEST_DSN
names an existing server's maintenance database. Each test gets its own database,
cloned from a template in which ``CREATE EXTENSION fairq`` already ran.
FAIRQ_TEST_EXTENSION_VERSION installs an earlier released version instead (its
script must be installed too), to show that a new test fails on it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import psycopg
import psycopg.sql
import pytest

from fairq.cluster import Cluster

TEMPLATE = "fairq_template"
_counter = itertools.count()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run the long profiles too")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="long profile: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


class Server:
    """Where the test server is, and how to make databases on it."""

    def __init__(self, admin_dsn: str, cluster: Cluster | None) -> None:
        self.admin_dsn = admin_dsn
        self.cluster = cluster

    def dsn(self, dbname: str) -> str:
        return psycopg.conninfo.make_conninfo(self.admin_dsn, dbname=dbname)

    def admin(self, sql: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def create_database(self, template: str = TEMPLATE) -> str:
        name = f"fairq_test_{os.getpid()}_{next(_counter)}"
        self.admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}" STRATEGY FILE_COPY')
        return name

    def drop_database(self, name: str) -> None:
        self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    existing = os.environ.get("FAIRQ_TEST_DSN")
    cluster: Cluster | None = None
    if existing:
        srv = Server(existing, None)
    else:
        cluster = Cluster(settings={"fsync": "off", "synchronous_commit": "off",
                                    "full_page_writes": "off", "max_connections": "300",
                                    "shared_buffers": "256MB"}).start()
        srv = Server(cluster.dsn("postgres"), cluster)
    # (The template is made inside the try: a session whose setup fails, say on a
    # version that is not installed, still removes its cluster.)
    try:
        srv.admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}"')
        srv.admin(f'CREATE DATABASE "{TEMPLATE}"')
        with psycopg.connect(srv.dsn(TEMPLATE), autocommit=True) as conn:
            version = os.environ.get("FAIRQ_TEST_EXTENSION_VERSION")
            if version:
                conn.execute(psycopg.sql.SQL("CREATE EXTENSION fairq VERSION {}").format(version))
            else:
                conn.execute("CREATE EXTENSION fairq")
        yield srv
    finally:
        if cluster is not None:
            cluster.remove()
        else:
            srv.admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}"')


@pytest.fixture
def dsn(server: Server) -> Iterator[str]:
    """Conninfo of a fresh database with fairq installed, dropped after the test."""
    name = server.create_database()
    try:
        yield server.dsn(name)
    finally:
        server.drop_database(name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the test's database: every call is its own transaction."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection
