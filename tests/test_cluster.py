"""The throwaway clusters that the tests, the bench and the demo start."""

from __future__ import annotations

import psycopg

from fairq.cluster import Cluster


def test_settings_with_spaces_commas_and_quotes_reach_the_server() -> None:
    """pg_ctl hands its options to a shell: unquoted, these split and the start failed."""
    settings = {"log_line_prefix": "%m [%p] ", "search_path": "public, pg_catalog",
                "application_name": "it's $HOME; true"}
    cluster = Cluster(settings=settings).start()
    try:
        with psycopg.connect(cluster.dsn()) as conn:
            shown = {name: conn.execute(f"SELECT current_setting('{name}')").fetchone()
                     for name in settings}
        assert shown == {name: (value,) for name, value in settings.items()}
    finally:
        cluster.remove()
