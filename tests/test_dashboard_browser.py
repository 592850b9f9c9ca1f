"""The dashboard in a real browser: headless Chromium (Debian's, driven by Playwright)
against a dashboard serving tests/dashboard_scene.py's database. The pages show the
database's numbers, the buttons do what they say (checked in the database), the
numbers refresh by themselves, read-only means no buttons and refused POSTs, and a
channel named like a script stays text.

Screenshots of every page land in the test's temporary directory, or in
FAIRQ_SCREENSHOTS (``FAIRQ_SCREENSHOTS=docs/dashboard pytest tests/test_dashboard_browser.py``
refreshes the README's pictures)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("starlette")
from dashboard_scene import (
    ERROR_HTML,
    XSS,
    Scene,
    build_scene,
    chromium_or_skip,
    observer_dsn,
)
from fairq.dashboard.app import Settings
from fairq.dashboard.csrf import COOKIE
from fairq.dashboard.server import Running, start

if os.environ.get("CI") != "true":
    pytest.importorskip("playwright")
from playwright.sync_api import Browser, Page, expect, sync_playwright

WAIT_MS = 30_000  # the most any expectation waits for the page to catch up
expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium_or_skip()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable)
        yield chromium
        chromium.close()


@pytest.fixture
def scene(dsn: str) -> Scene:
    return build_scene(dsn)


@pytest.fixture
def dashboard() -> Iterator[Any]:
    running: list[Running] = []

    def serve(dsn: str, **options: Any) -> str:
        options.setdefault("interval", timedelta(seconds=30))
        running.append(start(Settings(dsn, **options)))
        return running[-1].url.rstrip("/")

    serve.running = running  # type: ignore[attr-defined]

    yield serve
    for server in running:
        server.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.set_default_timeout(WAIT_MS)
    yield page
    context.close()
    assert dialogs == [], f"a script ran in the page: {dialogs}"


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("FAIRQ_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def rows(dsn: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchall()  # type: ignore[arg-type]


def add_an_hour_of_history(dsn: str) -> None:
    """Settled messages over the last hour (the chart's source), written as the owner:
    what workers running with fairq.history = on would have left."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        # One message every `every` seconds, thinned out in waves; waits that swing.
        conn.execute("""
            INSERT INTO fairq.message_history
                (id, queue, channel, priority, created_at, first_dequeued_at, settled_at,
                 num_attempts, outcome)
            SELECT 1000000 + g, q.queue, 'tenant-' || (g % 7), 0,
                   t - make_interval(secs => q.wait * (1.1 + sin(g / 150.0))),
                   t, t + interval '50 ms', 1, 'completed'
              FROM (VALUES ('default', 1.2, 1.0), ('emails', 0.4, 2.5)) q(queue, wait, every)
             CROSS JOIN generate_series(1, 3480) g
             CROSS JOIN LATERAL (SELECT clock_timestamp() - interval '58 min'
                                        + make_interval(secs => g * q.every)) x(t)
             WHERE x.t < clock_timestamp() - interval '5 s'
               AND g % 10 < 5 + 5 * sin(g * q.every / 600.0)""")


def test_pages_show_what_the_database_holds(dsn: str, scene: Scene, dashboard: Any,
                                            page: Page, shots: Path) -> None:
    for i in range(12):  # a few more tenants, so the channel page has something to sort
        rows(dsn, "SELECT fairq.message_create_batch(array_fill(%s::text, ARRAY[%s]),"
                  " array_fill('x'::bytea, ARRAY[%s]))", (f"tenant-{i:02d}", 3 + i * 7, 3 + i * 7))
    rows(dsn, "SELECT fairq.channel_set('tenant-05', p_max_concurrency => 4,"
              " p_release_interval_ms => 100, p_weight => 5)")
    add_an_hour_of_history(dsn)
    url = dashboard(dsn)

    page.goto(url + "/")
    for queue, channels, size, ready, scheduled, in_flight, dead in rows(
            dsn, "SELECT queue, channels, size, ready, scheduled, in_flight, dead"
                 " FROM fairq.queues"):
        row = page.locator(f'#queues tr[data-queue="{queue}"]')
        for cell, value in (("channels", channels), ("size", size), ("ready", ready),
                            ("scheduled", scheduled), ("in_flight", in_flight),
                            ("dead", dead)):
            expect(row.locator(f"td.{cell}")).to_have_text(f"{value:,}")
    expect(page.locator(".chart-source")).to_have_attribute("data-source", "history")
    # The chart's first panel: deliveries per second, per queue, from the history.
    series = page.locator("figure.panel").first.locator('polyline[data-queue="emails"]')
    plotted = [float(v) for v in (series.get_attribute("data-values") or "").split(",")]
    assert 0.1 < max(plotted) < 0.5  # about one per 2.5 s at most (and the scene's own)
    page.screenshot(path=str(shots / "queues.png"), full_page=True)

    page.goto(url + "/channels?queue=default&sort=backlog")
    capped = page.locator('#channels tr[data-channel="tenant-b"]')
    expect(capped.locator("td.in_flight")).to_have_text("1 / 1")
    expect(capped).to_have_class("at-cap")
    expect(page.locator('#channels tr[data-channel="paused-c"] td.paused_until')).to_have_text(
        "until resumed")
    tenant5 = page.locator('#channels tr[data-channel="tenant-05"]')
    expect(tenant5.locator("td.rate")).to_have_text("1 per 100 ms")
    expect(tenant5.locator("td.weight")).to_have_text("5")
    names = page.locator("#channels td.channel").all_inner_texts()
    assert XSS in names  # the script-named channel, shown as its own text
    ready = [int(t.replace(",", "")) for t in
             page.locator("#channels td.ready").all_inner_texts()]
    assert ready == sorted(ready, reverse=True)
    assert ready[0] == rows(dsn, "SELECT max(ready) FROM fairq.channels")[0][0]
    page.screenshot(path=str(shots / "channels.png"), full_page=True)

    page.goto(url + "/in-flight")
    shown = {int(i) for i in page.locator("#expiring tr[data-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.id)")}
    assert shown == set(scene.in_flight_ids)
    expect(page.locator(f'#recovered tr[data-id="{scene.recovered_id}"]')).to_contain_text(
        "in flight again")
    page.screenshot(path=str(shots / "in-flight.png"), full_page=True)

    page.goto(url + "/dead-letters")
    errors = page.locator("#dead-letters td.error-text").all_inner_texts()
    assert errors == ["timeout after 30 s", ERROR_HTML]  # the latest death first, as text
    page.screenshot(path=str(shots / "dead-letters.png"), full_page=True)


def test_retry_and_delete_buttons(dsn: str, scene: Scene, dashboard: Any, page: Page) -> None:
    retried, deleted = scene.dead_ids
    page.goto(dashboard(dsn) + "/dead-letters")
    with page.expect_navigation():
        page.locator(f'#dead-letters tr[data-id="{retried}"] button.retry').click()
    expect(page.locator("#notice")).to_have_text(f"dead letter {retried}: requeued")
    assert rows(dsn, "SELECT status::text FROM fairq.message WHERE id = %s", (retried,)) == [
        ("ready",)]
    assert rows(dsn, "SELECT id FROM fairq.dead_letters") == [(deleted,)]
    expect(page.locator(f'#dead-letters tr[data-id="{retried}"]')).to_have_count(0)

    with page.expect_navigation():
        page.locator(f'#dead-letters tr[data-id="{deleted}"] button.delete').click()
    expect(page.locator("#notice")).to_have_text(f"dead letter {deleted}: deleted")
    assert rows(dsn, "SELECT count(*) FROM fairq.dead_letters") == [(0,)]
    assert rows(dsn, "SELECT count(*) FROM fairq.message WHERE id = %s", (deleted,)) == [(0,)]


def test_pause_and_resume_buttons(dsn: str, scene: Scene, dashboard: Any, page: Page) -> None:
    url = dashboard(dsn)
    page.goto(url + "/channels?queue=default")
    row = page.locator('#channels tr[data-channel="tenant-a"]')
    row.locator("select").select_option(label="for 10 min")
    with page.expect_navigation():
        row.locator("button.pause").click()
    expect(row.locator("td.paused_until")).to_contain_text("until 20")
    (left,) = rows(dsn, "SELECT extract(epoch FROM paused_until - clock_timestamp())"
                        " FROM fairq.channels WHERE channel = 'tenant-a'")[0]
    assert 590 < left <= 600
    with page.expect_navigation():
        row.locator("button.resume").click()
    expect(row.locator("td.paused_until")).to_have_text("—")
    assert rows(dsn, "SELECT paused_until FROM fairq.channels WHERE channel = 'tenant-a'") == [
        (None,)]

    page.goto(url + "/")
    queue = page.locator('#queues tr[data-queue="emails"]')
    with page.expect_navigation():
        queue.locator("button.pause").click()  # until resumed: the default choice
    expect(queue.locator("td.paused_until")).to_have_text("until resumed")
    assert rows(dsn, "SELECT paused_until = 'infinity' FROM fairq.queues"
                     " WHERE queue = 'emails'") == [(True,)]
    with page.expect_navigation():
        queue.locator("button.resume").click()
    expect(queue.locator("td.paused_until")).to_have_text("—")
    assert rows(dsn, "SELECT paused_until FROM fairq.queues WHERE queue = 'emails'") == [
        (None,)]


def test_numbers_refresh_by_themselves(dsn: str, scene: Scene, dashboard: Any,
                                       page: Page) -> None:
    page.goto(dashboard(dsn, interval=timedelta(milliseconds=300)) + "/")
    page.evaluate("window.stillTheSamePage = true")
    ready = page.locator('#queues tr[data-queue="emails"] td.ready')
    before = int(ready.inner_text())
    rows(dsn, "SELECT fairq.message_create_batch(array_fill('late'::text, ARRAY[5]),"
              " array_fill('x'::bytea, ARRAY[5]), p_queue => 'emails')")
    expect(ready).to_have_text(str(before + 5))
    assert page.evaluate("window.stillTheSamePage") is True  # swapped in, not reloaded
    assert int(page.locator("#live-status").get_attribute("data-updates") or 0) > 0


def test_read_only_shows_no_buttons_and_refuses_posts(dsn: str, scene: Scene, dashboard: Any,
                                                      page: Page) -> None:
    url = dashboard(dsn, read_only=True)
    for path in ("/", "/channels?queue=default", "/in-flight", "/dead-letters"):
        page.goto(url + path)
        expect(page.locator("button")).to_have_count(0)
        expect(page.locator("#read-only")).to_have_text("read-only")
    # Even a POST that passes every CSRF check (no page offers its token here).
    session = next(c["value"] for c in page.context.cookies() if c["name"] == COOKIE)
    token = dashboard.running[-1].dashboard.csrf.token(session)
    answer = page.evaluate("""([id, token]) => fetch('/actions/delete', {method: 'POST',
        body: new URLSearchParams({id: String(id), csrf_token: token})})
        .then(r => r.text().then(text => [r.status, text]))""", [scene.dead_ids[0], token])
    assert answer[0] == 403 and "read-only" in answer[1]
    assert rows(dsn, "SELECT count(*) FROM fairq.dead_letters") == [(2,)]


def test_an_observer_is_shown_the_databases_refusal(dsn: str, scene: Scene, dashboard: Any,
                                                    page: Page) -> None:
    page.goto(dashboard(observer_dsn(dsn)) + "/dead-letters")
    with page.expect_navigation():
        page.locator("button.retry").first.click()
    expect(page.locator("#error")).to_contain_text(
        "the database refused: permission denied for function dead_letter_retry")
    assert rows(dsn, "SELECT count(*) FROM fairq.dead_letters") == [(2,)]
