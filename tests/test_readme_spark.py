"""The README's Spark example, as written: a Parquet file of tenant jobs goes into
fairq through PySpark, and `fairq report` writes its page from the queue's history."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

from fairq.spark import DEFAULT_JDBC_JAR
from test_readme_examples import block


def test_readme_spark_example_enqueues_a_parquet_file_and_reports(dsn: str, tmp_path: Path) -> None:
    if not Path(DEFAULT_JDBC_JAR).is_file() and not os.environ.get("CI"):
        pytest.skip("no JDBC driver (apt-get install libpostgresql-jdbc-java)")
    env = {**os.environ, "DATABASE_URL": dsn}
    # A Parquet file of 30 jobs over 3 tenants, then the README's block in the same
    # interpreter (local_session() returns the running session).
    make_jobs = textwrap.dedent("""
        from fairq.spark import local_session
        spark = local_session(app_name="make-jobs")
        rows = [(f"tenant-{i % 3}", i, {"n": i}) for i in range(30)]
        spark.createDataFrame(rows, "tenant string, job_id int, payload struct<n:int>") \\
             .write.parquet("jobs.parquet")
    """)
    script = make_jobs + block("Spark", "python")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "created=30" in run.stdout.replace(" ", ""), run.stdout

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(DISTINCT channel), sum(size) FROM fairq.channels"
                            ).fetchone() == (3, 30)
        conn.execute("SET fairq.history = on")
        while rows := conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(60000, 50)"
                                   ).fetchall():
            conn.execute("SELECT fairq.message_complete_batch(%s, %s)",
                         ([r[0] for r in rows], [r[1] for r in rows]))

    command = block("Spark", "sh").split("#", 1)[0].strip().split()
    assert command[:2] == ["fairq", "report"]
    args = [a.replace('"$DATABASE_URL"', dsn) for a in command[2:]]
    report = subprocess.run([str(Path(sys.executable).parent / "fairq"), "report", *args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "tenant-0" in page or "tenant-0" in (tmp_path / "report").joinpath(
        "channels.csv").read_text() if (tmp_path / "report" / "channels.csv").exists() else True
