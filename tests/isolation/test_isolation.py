"""PostgreSQL's isolation tester runs the specs in tests/isolation/specs.

Each spec interleaves fairq calls from several sessions in chosen orders
(permutations) and compares what every step printed with expected/<spec>.out; a
step that blocks shows as ``<waiting ...>``. pg_isolation_regress (shipped with the
server, under lib/pgxs/src/test/isolation) runs them against a throwaway cluster of
the PostgreSQL that fairq.cluster chooses, into which fairq must be installed
(``make install``). Each spec names the guard it exercises; README.md here says how
each was shown to fail without it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fairq.cluster import Cluster, pg_bindir, pg_config

HERE = Path(__file__).resolve().parent
SPECS = sorted(path.stem for path in (HERE / "specs").glob("*.spec"))


def isolation_regress() -> Path:
    pgxs = subprocess.run([pg_config(), "--pgxs"], check=True, capture_output=True,
                          text=True).stdout.strip()
    # .../lib/pgxs/src/makefiles/pgxs.mk -> .../lib/pgxs/src/test/isolation/
    return Path(pgxs).parent.parent / "test" / "isolation" / "pg_isolation_regress"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if not isolation_regress().is_file():
        why = f"this PostgreSQL has no isolation tester ({isolation_regress()})"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI's builds have one")
        pytest.skip(why)
    cluster = Cluster(settings={"fsync": "off"}).start()
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.mark.parametrize("spec", SPECS)
def test_spec(spec: str, cluster: Cluster, tmp_path: Path) -> None:
    done = subprocess.run(
        [str(isolation_regress()), f"--bindir={pg_bindir()}", "--host=127.0.0.1",
         f"--port={cluster.port}", f"--user={cluster.user}", "--dbname=fairq_isolation",
         f"--inputdir={HERE}", f"--outputdir={tmp_path}", spec],
        capture_output=True, text=True, timeout=300)
    diffs = tmp_path / "regression.diffs"
    assert done.returncode == 0, (diffs.read_text() if diffs.exists() else "") + done.stdout \
        + done.stderr


def test_every_spec_has_its_expected_output() -> None:
    assert SPECS
    expected = sorted(path.stem for path in (HERE / "expected").glob("*.out"))
    assert expected == SPECS
