"""The dashboard over plain HTTP: what it escapes, what it refuses (cross-site POSTs,
read-only mode, foreign Host headers, an observer's actions), /metrics against the
database, and the two commands. The browser's view is tests/test_dashboard_browser.py."""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode, urlsplit

import psycopg
import pytest

pytest.importorskip("starlette")
from prometheus_client.parser import text_string_to_metric_families

from dashboard_scene import ERROR_HTML, XSS, Scene, build_scene, observer_dsn
from fairq.dashboard.app import Settings
from fairq.dashboard.csrf import COOKIE, Csrf
from fairq.dashboard.server import Running, start


@dataclass
class Client:
    """A browser's worth of HTTP: one cookie jar, its own origin."""

    url: str
    csrf: Csrf  # the dashboard's, to forge what a page would have carried
    cookies: dict[str, str] = field(default_factory=dict)

    def request(self, method: str, path: str, body: dict[str, str] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port)
        sent = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()),
                **(headers or {})}
        data = None
        if body is not None:
            data = urlencode(body)
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        text = response.read().decode()
        for name, value in response.getheaders():
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                self.cookies[key] = rest.split(";", 1)[0]
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, text

    def get(self, path: str) -> str:
        status, _, text = self.request("GET", path)
        assert status == 200, text
        return text

    def token(self, path: str = "/dead-letters") -> str:
        match = re.search(r'name="csrf_token" value="([0-9a-f]+)"', self.get(path))
        assert match, "no CSRF token in the page's forms"
        return match.group(1)

    def post(self, action: str, form: dict[str, str],
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
        origin = self.url.rstrip("/")
        return self.request("POST", f"/actions/{action}", form,
                            {"Origin": origin, **(headers or {})})


@pytest.fixture
def scene(dsn: str) -> Scene:
    return build_scene(dsn)


@pytest.fixture
def serve() -> Iterator[Any]:
    running: list[Running] = []

    def serve(dsn: str, **options: Any) -> Client:
        options.setdefault("interval", timedelta(seconds=30))  # samples on demand only
        running.append(start(Settings(dsn, **options)))
        return Client(running[-1].url, running[-1].dashboard.csrf)

    yield serve
    for server in running:
        server.stop()


def test_every_name_and_error_is_escaped(dsn: str, scene: Scene, serve: Any) -> None:
    client = serve(dsn)
    channels = client.get("/channels?queue=default")
    assert XSS not in channels
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in channels
    dead = client.get("/dead-letters")
    assert ERROR_HTML not in dead and "<img" not in dead
    assert "&lt;img src=x onerror=alert(2)&gt; &amp; &#34;boom&#34;" in dead
    # The page says no inline script may run, whatever got through.
    _, headers, _ = client.request("GET", "/")
    assert "default-src 'self'" in headers["content-security-policy"]


def test_posts_need_the_token_and_this_origin(dsn: str, scene: Scene, serve: Any) -> None:
    client = serve(dsn)
    token = client.token()
    victim = str(scene.dead_ids[0])
    refused = [
        client.post("retry", {"id": victim}),  # no token
        client.post("retry", {"id": victim, "csrf_token": "0" * 64}),  # a wrong one
        client.post("retry", {"id": victim, "csrf_token": token},
                    {"Origin": "http://evil.example"}),
        client.post("retry", {"id": victim, "csrf_token": token},
                    {"Sec-Fetch-Site": "cross-site"}),
        # Another browser (no session cookie) with a token it copied from ours.
        Client(client.url, client.csrf).post("retry", {"id": victim, "csrf_token": token}),
    ]
    assert [status for status, _, _ in refused] == [403] * 5
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.dead_letters WHERE id = %s",
                            (victim,)).fetchone() == (1,)
    status, headers, _ = client.post("retry", {"id": victim, "csrf_token": token,
                                               "next": "/dead-letters?queue=emails"})
    assert status == 303
    assert headers["location"].startswith("/dead-letters?queue=emails&notice=dead+letter")
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.dead_letters WHERE id = %s",
                            (victim,)).fetchone() == (0,)
        assert conn.execute("SELECT status::text FROM fairq.message WHERE id = %s",
                            (victim,)).fetchone() == ("ready",)


def test_next_never_leaves_the_dashboard(dsn: str, scene: Scene, serve: Any) -> None:
    client = serve(dsn)
    token = client.token()
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
        status, headers, _ = client.post("resume-queue", {
            "queue": "default", "csrf_token": token, "next": target})
        assert status == 303 and headers["location"].startswith("/?notice="), target


def test_read_only_has_no_forms_and_refuses_posts(dsn: str, scene: Scene, serve: Any) -> None:
    client = serve(dsn, read_only=True)
    for path in ("/", "/channels?queue=default", "/dead-letters", "/in-flight"):
        page = client.get(path)
        assert "<form" not in page and "<button" not in page, path
    # Even a POST that would pass every CSRF check (no page offers its token here).
    token = client.csrf.token(client.cookies[COOKIE])
    status, _, text = client.post("delete", {"id": str(scene.dead_ids[0]), "csrf_token": token})
    assert status == 403 and "read-only" in text
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.dead_letters").fetchone() == (2,)


def test_foreign_host_headers_are_refused(dsn: str, scene: Scene, serve: Any) -> None:
    """Bound to 127.0.0.1, only its own names are served: a page that rebinds its DNS
    name to 127.0.0.1 cannot read the dashboard."""
    client = serve(dsn)
    status, _, _ = client.request("GET", "/", headers={"Host": "evil.example"})
    assert status == 400


def test_beyond_loopback_only_the_names_given_are_served(dsn: str, scene: Scene,
                                                         serve: Any) -> None:
    """Bound to another address the Host check was off: a page rebinding its DNS name
    to that address could read the dashboard and act through it."""
    from fairq.dashboard.cli import dashboard_settings

    settings = dashboard_settings(dsn, host="0.0.0.0", allowed_hosts=["dash.example"],
                                  origins=["https://dash.example.com/"])
    assert "0.0.0.0" not in settings.allowed_hosts and "dash.example" in settings.allowed_hosts
    client = serve(dsn, allowed_hosts=settings.allowed_hosts, origins=settings.origins)
    assert client.request("GET", "/", headers={"Host": "evil.example"})[0] == 400
    assert client.request("GET", "/", headers={"Host": "dash.example"})[0] == 200
    # Behind a proxy that ends TLS, the browser's origin is the proxy's.
    token = client.token()
    proxied = client.post("resume-queue", {"queue": "default", "csrf_token": token},
                          {"Origin": "https://dash.example.com"})
    assert proxied[0] == 303
    assert client.post("resume-queue", {"queue": "default", "csrf_token": token},
                       {"Origin": "https://evil.example"})[0] == 403


def test_a_name_with_line_breaks_is_acted_on_as_itself(dsn: str, scene: Scene,
                                                       serve: Any) -> None:
    """A browser reads CR in a field's value as LF and sends LF as CRLF: Pause on
    "new\nline" paused a new channel "new\r\nline". The forms carry names encoded."""
    name = "new\nline\r"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_create(%s, 'x', p_queue => %s)", (name, name))
    client = serve(dsn)
    page = client.get("/channels?" + urlencode({"queue": name}))
    fields = re.findall(r'name="(queue|channel)" value="([^"]*)"', page)
    assert fields and all("\n" not in value and "\r" not in value for _, value in fields)
    channel_form = dict(fields[-2:])  # the channel row's form: its queue, then its name
    status, _, text = client.post("pause-channel", {**channel_form, "seconds": "",
                                                    "csrf_token": client.token()})
    assert status == 303, text
    with psycopg.connect(dsn) as conn:
        paused = conn.execute("SELECT queue, channel FROM fairq.channels"
                              " WHERE paused_until IS NOT NULL AND queue = %s", (name,)).fetchall()
    assert paused == [(name, name)]


TWIN = "ac\u200bme"  # "acme" with a zero-width space
REVERSER = "<b>x</b>\u202e"  # a right-to-left override, then whatever follows it
UNSEEN = re.compile(r"[\u200b\u202e\x00-\x09\x0b-\x1f]")  # (a page's own lines aside)


def test_names_that_would_look_alike_or_spill_are_shown_escaped(dsn: str, serve: Any) -> None:
    """A tenant's zero-width space made a twin of channel "acme" that looked the same,
    and an operator's Pause could act on either; a bidi override ran into the text
    after the name (the notice read backwards). The pages, the notice and /metrics
    show such characters as escapes, and a backslash doubled."""
    names = ("acme", TWIN, REVERSER, "tab\there", "back\\slash")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute("SELECT fairq.message_create(%s, 'x', p_queue => 'shown')", (name,))
    client = serve(dsn)
    page = client.get("/channels?queue=shown")
    cells = sorted(re.findall(r'<td class="channel">([^<]*(?:<[^/][^<]*)*)</td>', page))
    assert cells == sorted(["acme", "ac\\u200bme", "&lt;b&gt;x&lt;/b&gt;\\u202e",
                            "tab\\x09here", "back\\\\slash"])
    # (Only the rows' data attributes, which nothing displays, keep the names as they are.)
    assert not UNSEEN.search(re.sub(r'data-channel="[^"]*"', "", page))
    fields = re.findall(r'name="(queue|channel)" value="([^"]*)"', page)
    forms = [dict(fields[i:i + 2]) for i in range(2, len(fields), 2)]  # after the queue's
    reverser_form = next(f for f in forms if f["channel"] == "%3Cb%3Ex%3C%2Fb%3E%E2%80%AE")
    token = client.token("/channels?queue=shown")
    status, headers, _ = client.post("pause-channel", {**reverser_form, "seconds": "",
                                                       "csrf_token": token})
    assert status == 303
    notice = client.get(headers["location"])
    assert "channel &lt;b&gt;x&lt;/b&gt;\\u202e paused" in notice
    status, headers, text = client.request("GET", "/metrics")
    assert status == 200 and headers["x-content-type-options"] == "nosniff"
    labels = {dict(key[1]).get("channel") for key in metrics(text)} - {None}
    assert {"ac\\u200bme", "tab\\x09here", "back\\\\slash"} <= labels
    assert not UNSEEN.search(text)


def test_a_form_whose_bytes_are_not_utf8_changes_nothing(dsn: str, scene: Scene,
                                                          serve: Any) -> None:
    """Replaced by U+FFFD, such bytes named another channel, which the pause then made."""
    paused_channels = ("SELECT count(*) FILTER (WHERE channel LIKE '%\ufffd%'),"
                       " count(*) FILTER (WHERE paused_until IS NOT NULL) FROM fairq.channels")
    with psycopg.connect(dsn) as conn:
        before = conn.execute(paused_channels).fetchone()
    client = serve(dsn)
    token = client.token()
    for channel in (b"\xff\xfe", "%FF%FE"):  # the form's bytes; the name's encoding
        status, _, text = client.post("pause-channel", {"queue": "default", "channel": channel,
                                                        "seconds": "", "csrf_token": token})
        assert status == 400 and "UTF-8" in text, text
    status, _, text = client.post("retry", {"id": str(2**63), "csrf_token": token})
    assert status == 400 and "beyond bigint" in text, text
    with psycopg.connect(dsn) as conn:
        assert conn.execute(paused_channels).fetchone() == before


def test_pages_are_not_kept_by_browsers_or_proxies(dsn: str, scene: Scene, serve: Any) -> None:
    client = serve(dsn)
    for path in ("/", "/channels?queue=default", "/dead-letters", "/in-flight", "/metrics"):
        _, headers, _ = client.request("GET", path)
        assert headers["cache-control"] == "no-store", path


def test_hostile_requests_and_data_get_clear_answers(dsn: str, scene: Scene,
                                                     serve: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A message due in the year 20000 (psycopg loads no such year), and one
        # backdated to 2000 (its wait is since it was created, not 26 years).
        conn.execute("SELECT fairq.message_create('far', 'x', '20000-01-01', p_queue => 'odd')")
        conn.execute("SELECT fairq.message_create('old', 'x', '2000-01-01', p_queue => 'odd')")
    client = serve(dsn)
    assert "far" in client.get("/channels?queue=odd")
    found = metrics(client.get("/metrics"))
    assert found[("fairq_up", ())] == 1.0
    assert found[("fairq_queue_oldest_ready_age_seconds", (("queue", "odd"),))] < 3600
    for path in ("/channels?queue=a%00b", "/channels?after=a%00", "/in-flight?queue=%00",
                 "/dead-letters?queue=%00", "/channels?offset=99999999999999999999999"):
        status, _, text = client.request("GET", path)
        assert status == 400, (path, text)
    # A large body is refused before it is read, whatever it holds.
    status, _, _ = client.post("retry", {"id": "1", "csrf_token": client.token(),
                                         "padding": "x" * 100_000})
    assert status == 413


def test_paused_channels_are_not_behind(dsn: str, serve: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_create('held', 'x', clock_timestamp() - interval '1 day')")
        conn.execute("SELECT fairq.channel_pause('held')")
    found = metrics(serve(dsn).get("/metrics"))
    assert found[("fairq_queue_oldest_ready_age_seconds", (("queue", "default"),))] == 0


def test_in_flight_shows_the_day_a_message_was_first_delivered(dsn: str, serve: Any) -> None:
    """A message in flight since an earlier day showed only its time of day, as if
    delivered today."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_create('slow', 'x')")
        [(message_id,)] = conn.execute("SELECT id FROM fairq.message_dequeue(600000)").fetchall()
        conn.execute("UPDATE fairq.message SET first_dequeued_at = '2020-02-03 12:00:00+00'"
                     " WHERE id = %s", (message_id,))
    page = serve(dsn).get("/in-flight")
    row = page[page.index(f'<tr data-id="{message_id}"'):]
    assert "2020-02-0" in row[:row.index("</tr>")]


def test_messages_readable_means_all_three_tables(dsn: str, scene: Scene, serve: Any) -> None:
    """With SELECT on fairq.message alone (what the README said to grant) every page and
    /metrics failed on the tables the reads join."""
    reader = observer_dsn(dsn, "fairq_half_reader")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('GRANT SELECT ON fairq.message TO "fairq_half_reader"')
    client = serve(reader)
    assert client.request("GET", "/")[0] == 200
    assert client.request("GET", "/channels?queue=default")[0] == 200
    assert metrics(client.get("/metrics"))[("fairq_up", ())] == 1.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('GRANT SELECT ON fairq.channel, fairq.queue TO "fairq_half_reader"')
    assert "Oldest ready ages need" not in serve(reader).get("/")


def test_an_observer_sees_everything_it_may_and_the_refusals(dsn: str, scene: Scene,
                                                              serve: Any) -> None:
    client = serve(observer_dsn(dsn))
    queues = client.get("/")
    assert "fairq_watcher" in queues and "actions need the owner" in queues
    assert "Oldest ready ages need SELECT on fairq.message" in queues
    assert "&lt;script&gt;" in client.get("/channels?queue=default")
    in_flight = client.get("/in-flight")
    assert "The database refused: permission denied for table" in in_flight
    status, _, text = client.post("retry", {"id": str(scene.dead_ids[0]),
                                            "csrf_token": client.token()})
    assert status == 403
    assert "permission denied for function dead_letter_retry" in text
    assert "42501" in text


def metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def expected_queue_metrics(dsn: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT queue, channels, size, ready, scheduled, in_flight, dead,"
                            " paused_until IS NOT NULL FROM fairq.queues").fetchall()
        settled = conn.execute("SELECT queue, outcome, count(*), sum(num_attempts)"
                               " FROM fairq.message_history GROUP BY 1, 2").fetchall()
    expected = {}
    for queue, *values in rows:
        for name, value in zip(("channels", "size", "ready", "scheduled", "in_flight",
                                "dead_letters", "paused"), values, strict=True):
            expected[(f"fairq_queue_{name}", (("queue", queue),))] = float(value)
    deliveries: dict[str, float] = {}
    for queue, outcome, count, attempts in settled:
        expected[("fairq_settled_messages_total", (("outcome", outcome), ("queue", queue)))] = \
            float(count)
        deliveries[queue] = deliveries.get(queue, 0.0) + float(attempts)
    for queue, total in deliveries.items():
        expected[("fairq_deliveries_total", (("queue", queue),))] = total
    return expected


def test_metrics_match_the_database(dsn: str, scene: Scene, serve: Any) -> None:
    client = serve(dsn, top_channels=3)
    found = metrics(client.get("/metrics"))
    expected = expected_queue_metrics(dsn)
    assert {k: found.get(k) for k in expected} == expected
    assert found[("fairq_up", ())] == 1.0
    # Per-channel series: the three largest ready backlogs only, with their numbers.
    with psycopg.connect(dsn) as conn:
        top = conn.execute("SELECT queue, channel, ready, in_flight FROM fairq.channels"
                           " ORDER BY ready DESC, queue, channel LIMIT 3").fetchall()
    series = {labels for name, labels in found if name == "fairq_channel_ready"}
    assert series == {(("channel", c), ("queue", q)) for q, c, _, _ in top}
    for queue, channel, ready, in_flight in top:
        labels = (("channel", channel), ("queue", queue))
        assert found[("fairq_channel_ready", labels)] == ready
        assert found[("fairq_channel_in_flight", labels)] == in_flight
    assert found[("fairq_queue_oldest_ready_age_seconds", (("queue", "default"),))] > 0
    # The counters follow what is settled after the dashboard started.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET fairq.history = on")
        conn.execute("SELECT fairq.message_complete(id, num_attempts)"
                     " FROM fairq.message_dequeue(60000, 2, 'emails')")
    client.token()  # any page; then an action samples at once:
    client.post("resume-queue", {"queue": "emails", "csrf_token": client.token()})
    found = metrics(client.get("/metrics"))
    expected = expected_queue_metrics(dsn)
    assert {k: found.get(k) for k in expected} == expected


def test_a_read_the_database_never_answers_is_reported(dsn: str, scene: Scene) -> None:
    """A hung server (a stopped backend, a lock held for ever) raises nothing: the pages
    kept old numbers and /metrics said fairq_up 1. Here every read after the first
    waits until released."""
    from fairq.dashboard.metrics import live
    from fairq.dashboard.sampler import Sampler

    released = threading.Event()
    reads = 0

    @contextmanager
    def connect() -> Iterator[psycopg.Connection[Any]]:
        nonlocal reads
        reads += 1
        if reads > 1:
            released.wait(60)
        with psycopg.connect(dsn, autocommit=True) as conn:
            yield conn

    sampler = Sampler(connect, timedelta(milliseconds=50))
    sampler.start()  # the first read, at once
    try:
        deadline = time.monotonic() + 60
        while "no new sample" not in (sampler.error or ""):
            assert time.monotonic() < deadline, "the hung read was never reported"
            time.sleep(0.01)
        assert sampler.latest() is not None  # the pages still answer, from the last one
        collected = live(sampler, connect, 0)()
        assert collected.error is not None and "no new sample" in collected.error
    finally:
        released.set()
        sampler.stop()


def test_the_chart_keeps_the_busiest_queues_only(dsn: str) -> None:
    """An hour of samples of every queue grew without bound with the queues."""
    from fairq.dashboard.sampler import CHARTED_QUEUES, Sampler

    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in range(CHARTED_QUEUES + 5):
            conn.execute("SELECT fairq.message_create_batch(array_fill('c'::text, ARRAY[%s]),"
                         " array_fill('x'::bytea, ARRAY[%s]), p_queue => %s)",
                         (n + 1, n + 1, f"q{n:02}"))

    @contextmanager
    def connect() -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            yield conn

    sampler = Sampler(connect, timedelta(hours=1))
    sampler.sample_now()
    assert sorted(s.queue for s in sampler.sampled()) == [
        f"q{n:02}" for n in range(5, CHARTED_QUEUES + 5)]


def test_metrics_once_prints_the_same(dsn: str, scene: Scene) -> None:
    out = subprocess.run([sys.executable, "-m", "fairq", "metrics", "--once", "--dsn", dsn,
                          "--top-channels", "2"], capture_output=True, text=True, check=True)
    found = metrics(out.stdout)
    expected = expected_queue_metrics(dsn)
    assert {k: found.get(k) for k in expected} == expected
    assert len({labels for name, labels in found if name == "fairq_channel_size"}) == 2


def test_fairq_dashboard_serves_until_stopped(dsn: str, scene: Scene) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "fairq", "dashboard", "--dsn", dsn, "--port", "0",
         "--read-only"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+/) \(role postgres, read-only", line)
        assert match, line
        page = Client(match.group(1), Csrf()).get("/")
        assert 'data-queue="emails"' in page
    finally:
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal: exit status -15.
        code = process.wait(60)
        errors = process.stderr.read() if process.stderr else ""
    assert code in (0, -signal.SIGTERM) and "Traceback" not in errors, errors


def test_a_wrong_database_fails_at_start(dsn: str) -> None:
    missing = psycopg.conninfo.make_conninfo(dsn, dbname="no_such_database")
    out = subprocess.run([sys.executable, "-m", "fairq", "dashboard", "--dsn", missing,
                          "--port", "0"], capture_output=True, text=True)
    assert out.returncode == 1
    assert 'database "no_such_database" does not exist' in out.stderr


def test_the_cli_hands_both_commands_their_command_line() -> None:
    for command in ("dashboard", "metrics"):
        out = subprocess.run([sys.executable, "-m", "fairq", command, "--help"],
                             capture_output=True, text=True, check=True)
        assert out.stdout.startswith(f"usage: fairq {command}"), out.stdout


def test_fairq_metrics_serves_alone(dsn: str, scene: Scene) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "fairq", "metrics", "--dsn", dsn, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/metrics", line)
        assert match, line
        client = Client(match.group(1), Csrf())
        found = metrics(client.get("/metrics"))
        expected = expected_queue_metrics(dsn)
        assert {k: found.get(k) for k in expected} == expected
        # Any Host was served: a page whose DNS name resolves here read every name.
        status, _, _ = client.request("GET", "/metrics", headers={"Host": "evil.example"})
        assert status == 400
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0, process.stderr.read() if process.stderr else ""


def test_fairq_metrics_holds_two_connections_however_many_scrape(dsn: str, scene: Scene) -> None:
    """Each scrape of ``fairq metrics`` read the top channels on a connection of its
    own: scrapes that came together (a scraper's retries, anyone who can reach the
    port) took every connection slot of the server, and the application's own
    connections were refused. The exporter holds at most EXPORTER_CONNECTIONS; the
    scrapes beyond them wait for one. Here every read waits for a lock on the channel
    table, held until all the scrapes are answered (by the read's statement timeout,
    or the wait's), so each scrape holds whatever it took for as long as it can."""
    from fairq.dashboard.exporter import EXPORTER_CONNECTIONS

    process = subprocess.Popen(
        [sys.executable, "-m", "fairq", "metrics", "--dsn", dsn, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/metrics", process.stdout.readline())
        assert match
        url = match.group(1)
        assert Client(url, Csrf()).get("/metrics")  # started: the sampler has read once
        with psycopg.connect(dsn, autocommit=True) as locker, \
                psycopg.connect(dsn, autocommit=True) as watch:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE fairq.channel IN ACCESS EXCLUSIVE MODE")
            scrapes = [threading.Thread(target=Client(url, Csrf()).request, args=("GET", "/metrics"))
                       for _ in range(8)]
            for scrape in scrapes:
                scrape.start()
            most = 0
            while any(scrape.is_alive() for scrape in scrapes):
                row = watch.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name"
                                    " = 'fairq dashboard' AND datname = current_database()").fetchone()
                most = max(most, int(row[0]) if row else 0)
                time.sleep(0.01)
            locker.execute("ROLLBACK")
        assert most == EXPORTER_CONNECTIONS  # reached, never passed
        assert Client(url, Csrf()).get("/metrics")  # and it serves on
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0, process.stderr.read() if process.stderr else ""


def test_only_the_dashboards_own_notices_are_shown(dsn: str, scene: Scene, serve: Any) -> None:
    """An action's redirect carries its notice ("dead letter 7: requeued"), signed: a
    link with any ?notice= put its text on the page as the dashboard's own message
    (escaped, but a trusted place for a phishing line)."""
    client = serve(dsn)
    spoof = "dead letter 1: requeued. Re-authenticate at https://evil.example/login"
    for forged in ({"notice": spoof}, {"notice": spoof, "notice_sig": "0" * 64}):
        assert 'id="notice"' not in client.get(f"/dead-letters?{urlencode(forged)}")
    victim = str(scene.dead_ids[0])
    status, headers, _ = client.post("retry", {"id": victim, "csrf_token": client.token(),
                                               "next": "/dead-letters"})
    assert status == 303
    assert f'id="notice">dead letter {victim}: requeued<' in client.get(headers["location"])


def test_the_queues_page_and_metrics_show_the_queues_that_matter(
        dsn: str, scene: Scene, serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any producer may name a new queue, and queues are never removed: the page and
    the per-queue series listed every queue ever named (20 MB a refresh at 20,000).
    They show SHOWN_QUEUES: every paused queue, then those holding the most."""
    from fairq.dashboard import sampler

    with psycopg.connect(dsn, autocommit=True) as conn:
        named = {r[0] for r in conn.execute("SELECT queue FROM fairq.queues")}
        for i in range(4):  # named, then emptied: they hold nothing
            conn.execute("SELECT fairq.message_create('c', 'x', p_queue => %s)", (f"zz-spam-{i}",))
            conn.execute("SELECT fairq.message_complete(id, num_attempts)"
                         " FROM fairq.message_dequeue(60000, 1, %s)", (f"zz-spam-{i}",))
        conn.execute("SELECT fairq.queue_pause('zz-spam-3')")
    monkeypatch.setattr(sampler, "SHOWN_QUEUES", len(named) + 1)
    client = serve(dsn)
    page = client.get("/")
    shown = set(re.findall(r'<tr data-queue="([^"]+)"', page))
    assert shown == named | {"zz-spam-3"}  # the paused one, then those holding more
    assert 'id="queues-not-shown">3 more queues' in page
    found = metrics(client.get("/metrics"))
    assert {dict(labels)["queue"] for name, labels in found if name == "fairq_queue_size"} == shown
    assert found[("fairq_queues", ())] == len(named) + 4


def test_a_role_that_may_not_read_the_history_sees_the_rest(dsn: str, scene: Scene,
                                                            serve: Any) -> None:
    """The sample asked has_table_privilege(message_history) AND EXISTS (SELECT FROM
    message_history) in one statement: PostgreSQL checks a statement's tables before it
    runs, whatever the AND would have skipped, so a role without SELECT on the history
    (revoked from an observer, or granted only the other views) read no queue at all:
    every page failed and /metrics said fairq_up 0."""
    role = observer_dsn(dsn, "fairq_no_history")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('REVOKE SELECT ON fairq.message_history FROM "fairq_no_history"')
    client = serve(role)
    page = client.get("/")
    assert 'data-queue="emails"' in page and 'data-source="sampled"' in page
    assert "permission denied" not in page
    found = metrics(client.get("/metrics"))
    assert found[("fairq_up", ())] == 1.0
    assert ("fairq_queue_size", (("queue", "emails"),)) in found
    assert not any(name.startswith("fairq_settled") for name, _ in found)
    out = subprocess.run([sys.executable, "-m", "fairq", "metrics", "--once", "--dsn", role],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert metrics(out.stdout)[("fairq_up", ())] == 1.0


def test_connections_the_server_dropped_are_not_handed_out(dsn: str, scene: Scene,
                                                           serve: Any) -> None:
    """After a restart or failover of the database (or a pooler's idle timeout), the
    pool handed out its dead connections: each one failed a page with 500 ("terminating
    connection due to administrator command") and a scrape with fairq_up 0 before it
    was thrown away. A connection is checked before it is handed out."""
    client = serve(dsn, top_channels=2)
    for path in ("/", "/channels?queue=default", "/dead-letters", "/in-flight", "/metrics"):
        client.get(path)
    with psycopg.connect(dsn, autocommit=True) as conn:
        killed = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000))"
            " FROM pg_stat_activity WHERE application_name = 'fairq dashboard'"
            " AND datname = current_database()").fetchone()
    assert killed is not None and killed[0] >= 1
    for path in ("/channels?queue=default", "/dead-letters", "/in-flight",
                 "/channels?queue=emails&sort=backlog"):
        status, _, text = client.request("GET", path)
        assert status == 200, (path, re.findall(r'id="error">[^<]*', text))
    assert metrics(client.get("/metrics"))[("fairq_up", ())] == 1.0
    status, _, text = client.post("resume-queue", {"queue": "emails",
                                                   "csrf_token": client.token()})
    assert status == 303, re.findall(r'id="error">[^<]*', text)


def test_the_queues_page_stands_when_the_history_cannot_be_read(
        dsn: str, scene: Scene, serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's read of the last hour of fairq.message_history grows with the
    throughput (1.4 s for 3 million messages an hour here) and may wait for a lock: when
    it failed (the 10 s statement timeout), the Queues page answered 500 with no queue
    on it. The page shows the queues and the sampled chart, and says why. Here a lock
    on the history holds the read until the statement timeout, shortened to 0.5 s."""
    from fairq.dashboard import queries

    monkeypatch.setattr(queries, "STATEMENT_TIMEOUT_MS", 500)
    client = serve(dsn)
    with psycopg.connect(dsn, autocommit=True) as locker:
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE fairq.message_history IN ACCESS EXCLUSIVE MODE")
        status, _, page = client.request("GET", "/")
        locker.execute("ROLLBACK")
    assert status == 200, re.findall(r'id="error">[^<]*', page)
    assert 'data-queue="emails"' in page and 'data-source="sampled"' in page
    assert "fairq.message_history could not be read" in page
    assert "canceling statement due to statement timeout" in page


def test_the_settled_counters_stay_bounded_however_many_queues(
        dsn: str, serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-queue gauges keep to SHOWN_QUEUES queues, but the counters of settled
    messages had a series for every queue the history ever recorded (and one more per
    outcome): any producer may name a queue, so 20,000 of them were 20,000 to 60,000
    series. They keep to the SHOWN_QUEUES queues that settled the most."""
    from fairq.dashboard import sampler
    from fairq.dashboard.metrics import collect_once, families
    from fairq.dashboard.queries import connect

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET fairq.history = on")
        for queue, count in (("big", 3), ("mid", 2), ("one-a", 1), ("one-b", 1)):
            conn.execute("SELECT fairq.message_create_batch(array_fill('c'::text, ARRAY[%s]),"
                         " array_fill('x'::bytea, ARRAY[%s]), p_queue => %s)",
                         (count, count, queue))
            conn.execute("SELECT fairq.message_complete(id, num_attempts)"
                         " FROM fairq.message_dequeue(60000, %s, %s)", (count, queue))
    monkeypatch.setattr(sampler, "SHOWN_QUEUES", 3)
    found = metrics(serve(dsn).get("/metrics"))
    counted = {dict(labels)["queue"] for name, labels in found
               if name in ("fairq_settled_messages_total", "fairq_deliveries_total")}
    assert counted == {"big", "mid", "one-a"}  # the most settled; among equals, by name
    with connect(dsn) as conn:
        once = list(families(collect_once(conn, 0)))
    assert {s.labels["queue"] for family in once if family.name.startswith(("fairq_settled",
            "fairq_deliveries")) for s in family.samples} == counted


def test_a_session_token_is_never_a_notice_signature() -> None:
    """Both are HMACs under the dashboard's one secret: a session cookie reading
    "notice:<text>" had as its CSRF token the signature of that notice."""
    csrf = Csrf()
    notice = "dead letter 12 deleted" + " " * 20
    assert csrf.token("notice:" + notice) != csrf.notice_signature(notice)
    assert csrf.signed_notice(notice, csrf.token("notice:" + notice)) is None
