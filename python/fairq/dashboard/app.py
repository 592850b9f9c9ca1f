"""The dashboard's web application (Starlette): its pages, its actions and ``/metrics``.

Pages (GET, read-only, rendered by Jinja2 with autoescaping, so every queue name,
channel name and error text is shown as text): ``/`` the queues and the chart of the
last hour, ``/channels?queue=`` one queue's channels, ``/in-flight`` locks about to
expire and recovered messages, ``/dead-letters``. Each page refreshes its live parts
by itself (static/dashboard.js fetches the page again).

Actions (POST ``/actions/{name}``): retry or delete a dead letter, pause or resume a
channel or a queue. Each is one call of fairq's SQL functions as the dashboard's
role: the database decides who may, and its refusal is shown. ``--read-only`` hides
the buttons and refuses the POSTs; every POST must pass :mod:`fairq.dashboard.csrf`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from jinja2 import Environment, PackageLoader, StrictUndefined
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fairq import _sql
from fairq.dashboard import format as fmt
from fairq.dashboard import queries as q
from fairq.dashboard.charts import Chart, history_chart, sampled_chart
from fairq.dashboard.cli import LOOPBACK_HOSTS
from fairq.dashboard.csrf import FIELD, Csrf
from fairq.dashboard.metrics import live, registry
from fairq.dashboard.sampler import Sampler, Snapshot

__all__ = ["Dashboard", "Settings"]

# Sent with every page: scripts and styles from this dashboard only (so an injected
# tag would not run even if something escaped autoescaping), never framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    # Pages show tenants' names and dead letters' errors: no copy kept by a browser or
    # a proxy.
    "Cache-Control": "no-store",
}
#: The channels page's offset, at most (the SQL's is a bigint).
MAX_OFFSET = 1_000_000_000
#: An action's form is a few hundred bytes: a larger body is refused unread.
MAX_FORM_BYTES = 64 * 1024
PAUSES = (("", "until resumed"), ("60", "for 1 min"), ("600", "for 10 min"),
          ("3600", "for 1 h"))


@dataclass(frozen=True)
class Settings:
    dsn: str
    read_only: bool = False
    interval: timedelta = timedelta(seconds=5)  # sampling, and the pages' refresh
    top_channels: int = 20  # channels with per-channel gauges in /metrics
    page_size: int = 50
    # Host headers accepted (DNS rebinding: a page whose name resolves to this address
    # must not read it or act through it): the loopback names, the address listened on
    # and the names the operator gave (--allowed-host).
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    # Origins whose POSTs are accepted besides the address a request came to: a
    # proxy's public address (--origin).
    origins: tuple[str, ...] = ()


class BadRequest(Exception):
    """A request the dashboard cannot serve as asked (400, with the reason)."""


def _safe_next(target: str | None) -> str:
    """A path on this dashboard to go back to (never another site: "//host" is one)."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


def _with_notice(target: str, notice: str, signature: str) -> str:
    parts = urlsplit(target)
    query = ([(k, v) for k, v in parse_qsl(parts.query) if k not in ("notice", "notice_sig")]
             + [("notice", notice), ("notice_sig", signature)])
    return urlunsplit(("", "", parts.path, urlencode(query), ""))


def _database_error(exc: psycopg.Error) -> str:
    code = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
    return f"{str(exc).strip() or type(exc).__name__}{code}"


#: The database connections a dashboard holds at most, however many pages are asked for.
DASHBOARD_CONNECTIONS = 4


class Dashboard:
    """One dashboard: its connection pool, sampler, templates and metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pool: ConnectionPool[psycopg.Connection[Any]] = q.connection_pool(
            settings.dsn, DASHBOARD_CONNECTIONS)
        self.sampler = Sampler(self.connection, settings.interval)
        self.csrf = Csrf()
        self.templates = Environment(loader=PackageLoader("fairq.dashboard", "templates"),
                                     autoescape=True, undefined=StrictUndefined,
                                     trim_blocks=True, lstrip_blocks=True)
        self.templates.filters.update(fmt.FILTERS)
        self.registry = registry(live(self.sampler, self.connection, settings.top_channels))
        self.role = "?"
        self.role_may_act = False
        self._chart: tuple[datetime, Chart] | None = None
        self.ready = threading.Event()  # set once started: the pool and the sampler run

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self.pool.connection() as conn:
            yield conn

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(self.start)
        try:
            yield
        finally:
            await run_in_threadpool(self.stop)

    def start(self) -> None:
        self.pool.open(wait=True)
        with self.connection() as conn:
            self.role, self.role_may_act = q.role_summary(conn)
        self.sampler.start()
        self.ready.set()

    def stop(self) -> None:
        self.sampler.stop()
        self.pool.close()

    def app(self) -> Starlette:
        static = Path(__file__).with_name("static")
        middleware = [Middleware(TrustedHostMiddleware,
                                 allowed_hosts=list(self.settings.allowed_hosts))]
        return Starlette(routes=[
            Route("/", self.page(self.queues_page)),
            Route("/channels", self.page(self.channels_page)),
            Route("/in-flight", self.page(self.in_flight_page)),
            Route("/dead-letters", self.page(self.dead_letters_page)),
            Route("/metrics", self.metrics_page),
            Route("/actions/{action}", self.action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=static), name="static"),
        ], middleware=middleware, lifespan=self.lifespan)

    # ---- pages

    def page(self, build: Callable[[Request, psycopg.Connection[Any]], tuple[str, dict[str, Any]]]
             ) -> Callable[[Request], Response]:
        """A GET page: ``build`` returns its template and context; a database error or
        a bad request becomes the error page."""
        def endpoint(request: Request) -> Response:
            try:
                with self.connection() as conn:
                    template, context = build(request, conn)
            except BadRequest as exc:
                return self.render(request, "error.html", {"error": str(exc)}, 400)
            except psycopg.Error as exc:
                return self.render(request, "error.html", {"error": _database_error(exc)}, 500)
            return self.render(request, template, context)
        return endpoint

    def render(self, request: Request, template: str, context: dict[str, Any],
               status: int = 200) -> Response:
        session, new = self.csrf.session(request)
        snapshot = self.sampler.latest()
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        html = self.templates.get_template(template).render(
            settings=self.settings, read_only=self.settings.read_only, role=self.role,
            role_may_act=self.role_may_act, csrf_field=FIELD, csrf_token=self.csrf.token(session),
            # An error page answers a POST: fetching its address again would not do.
            refresh_ms=0 if template == "error.html"
            else int(self.settings.interval.total_seconds() * 1000),
            snapshot=snapshot, sampler_error=self.sampler.error, here=here,
            notice=self.csrf.signed_notice(request.query_params.get("notice"),
                                           request.query_params.get("notice_sig")),
            pauses=PAUSES,
            **{"active": None, "back": "/", **context})
        response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
        if new:
            self.csrf.set_cookie(response, session)
        return response

    def _snapshot(self) -> Snapshot:
        snapshot = self.sampler.latest() or self.sampler.sample_now()
        if snapshot is None:
            raise BadRequest(f"the queues could not be read: {self.sampler.error}")
        return snapshot

    def chart(self, conn: psycopg.Connection[Any], snapshot: Snapshot) -> Chart:
        """The chart, read at most once per snapshot (the history's last hour may be
        many rows). Two requests at once may both draw it: harmless, so no lock."""
        if self._chart is not None and self._chart[0] == snapshot.taken_at:
            return self._chart[1]
        chart, failure = None, None
        if snapshot.history:
            # The last hour of history grows with the throughput (1.4 s for 3 million
            # messages an hour) and may wait for a lock: its failure failed the whole
            # Queues page with 500. The page shows the sampled chart instead, and why
            # (kept for this snapshot: the next pages do not try again at once).
            try:
                chart = history_chart(conn, snapshot.taken_at)
            except psycopg.Error as exc:
                failure = _database_error(exc)
        if chart is None:
            chart = sampled_chart(self.sampler.sampled(),
                                  self.sampler.started_at or snapshot.taken_at,
                                  snapshot.taken_at, self.settings.interval,
                                  snapshot.reads_messages,
                                  None if failure is None else
                                  f"fairq.message_history could not be read ({failure})")
        self._chart = (snapshot.taken_at, chart)
        return chart

    def queues_page(self, request: Request,
                    conn: psycopg.Connection[Any]) -> tuple[str, dict[str, Any]]:
        snapshot = self._snapshot()
        shown = snapshot.shown_queues()
        return "queues.html", {"active": "queues", "queues": shown,
                               "not_shown": len(snapshot.queues) - len(shown),
                               "chart": self.chart(conn, snapshot)}

    def channels_page(self, request: Request,
                      conn: psycopg.Connection[Any]) -> tuple[str, dict[str, Any]]:
        params = request.query_params
        queue = _text(request, "queue") or "default"
        try:
            sort = q.ChannelSort(params.get("sort", "name"))
            offset = max(0, int(params.get("offset", "0")))
        except ValueError as exc:
            raise BadRequest(f"bad paging or sort: {exc}") from exc
        if offset > MAX_OFFSET:
            raise BadRequest(f"bad paging: offset over {MAX_OFFSET}")
        snapshot = self._snapshot()
        started = time.perf_counter()
        page = q.channel_page(conn, queue, sort, self.settings.page_size,
                              snapshot.reads_messages, after=_text(request, "after"),
                              before=_text(request, "before"), offset=offset)
        elapsed = time.perf_counter() - started
        return "channels.html", {
            "active": "channels", "queue": queue, "sort": sort, "sorts": list(q.ChannelSort),
            "page": page, "read_ms": elapsed * 1000, "now": _now(conn),
            "queue_row": next((r for r in snapshot.queues if r.queue == queue), None),
            "reads_messages": snapshot.reads_messages}

    def in_flight_page(self, request: Request,
                       conn: psycopg.Connection[Any]) -> tuple[str, dict[str, Any]]:
        queue = _text(request, "queue") or None
        limit = self.settings.page_size
        error = None
        expiring: list[q.InFlightRow] = []
        recovered: list[q.RecoveredRow] = []
        try:
            expiring = q.expiring(conn, queue, limit)
            recovered = q.recovered(conn, queue, limit)
        except psycopg.errors.InsufficientPrivilege as exc:
            error = _database_error(exc)
        return "in_flight.html", {"active": "in_flight", "queue": queue, "expiring": expiring,
                                  "recovered": recovered, "error": error}

    def dead_letters_page(self, request: Request,
                          conn: psycopg.Connection[Any]) -> tuple[str, dict[str, Any]]:
        queue = _text(request, "queue") or None
        try:
            page = q.dead_letter_page(conn, queue, self.settings.page_size,
                                      _text(request, "before"))
        except (ValueError, psycopg.errors.DataError) as exc:
            raise BadRequest(f"bad paging cursor: {exc}") from exc
        return "dead_letters.html", {"active": "dead_letters", "queue": queue, "page": page}

    # ---- /metrics

    def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST,
                        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})

    # ---- actions

    async def action(self, request: Request) -> Response:
        if self.settings.read_only:
            return self.render(request, "error.html", {
                "error": "this dashboard is read-only (--read-only): actions are refused"}, 403)
        refusal = self.csrf.origin_refusal(request, self.settings.origins)
        if refusal is not None:
            return self.render(request, "error.html", {"error": refusal}, 403)
        body = await _bounded_body(request)
        if body is None:
            return self.render(request, "error.html", {
                "error": f"request body over {MAX_FORM_BYTES} bytes refused"}, 413)
        try:
            form = dict(parse_qsl(body.decode("utf-8"), errors="strict"))
        except UnicodeDecodeError:
            # (Replaced, bytes that were not UTF-8 named another channel, which the
            # pause then made.)
            return self.render(request, "error.html", {
                "error": "the form is not UTF-8: refused, nothing changed"}, 400)
        refusal = self.csrf.token_refusal(request, form)
        if refusal is not None:
            return self.render(request, "error.html", {"error": refusal}, 403)
        back = _safe_next(form.get("next"))
        try:
            notice = await run_in_threadpool(self._act, request.path_params["action"], form)
        except BadRequest as exc:
            return self.render(request, "error.html", {"error": str(exc), "back": back}, 400)
        except psycopg.Error as exc:
            status = 403 if isinstance(exc, psycopg.errors.InsufficientPrivilege) else 400
            return self.render(request, "error.html", {
                "error": f"the database refused: {_database_error(exc)}", "back": back}, status)
        # The pages show the snapshot: take a fresh one so the change shows at once.
        await run_in_threadpool(self.sampler.sample_now)
        return RedirectResponse(_with_notice(back, notice, self.csrf.notice_signature(notice)),
                                status_code=303)

    def _act(self, action: str, form: dict[str, str]) -> str:
        def field(name: str) -> str:
            value = form.get(name)
            if not value:
                raise BadRequest(f"missing form field {name!r}")
            return value

        def named(name: str) -> str:  # a queue's or channel's (format.form_name)
            try:
                return fmt.from_form(field(name))
            except ValueError as exc:
                raise BadRequest(f"bad {name}: its bytes are not UTF-8") from exc

        def seconds() -> float | None:
            value = form.get("seconds") or None
            try:
                return float(value) if value is not None else None
            except ValueError as exc:
                raise BadRequest(f"bad pause length {value!r}") from exc

        def shown(name: str) -> str:  # for the notice
            return fmt.shown(named(name))

        with self.connection() as conn:
            if action in ("retry", "delete"):
                try:
                    message_id = int(field("id"))
                except ValueError as exc:
                    raise BadRequest(f"bad message id {form.get('id')!r}") from exc
                if message_id not in _sql.BIGINT:
                    raise BadRequest(f"bad message id {message_id}: beyond bigint")
                run = q.dead_letter_retry if action == "retry" else q.dead_letter_delete
                return f"dead letter {message_id}: {run(conn, message_id)}"
            if action == "pause-channel":
                q.pause_channel(conn, named("queue"), named("channel"), seconds())
                return f"channel {shown('channel')} paused"
            if action == "resume-channel":
                was = q.resume_channel(conn, named("queue"), named("channel"))
                return f"channel {shown('channel')} " + ("resumed" if was else "was not paused")
            if action == "pause-queue":
                q.pause_queue(conn, named("queue"), seconds())
                return f"queue {shown('queue')} paused"
            if action == "resume-queue":
                was = q.resume_queue(conn, named("queue"))
                return f"queue {shown('queue')} " + ("resumed" if was else "was not paused")
        raise BadRequest(f"no such action: {action!r}")


def _text(request: Request, name: str) -> str | None:
    """A text parameter of the query string (PostgreSQL's text holds no NUL: one in a
    name or a cursor failed the page with 500)."""
    value = request.query_params.get(name)
    if value is not None and "\x00" in value:
        raise BadRequest(f"bad {name}: it holds a NUL character")
    return value


async def _bounded_body(request: Request) -> bytes | None:
    """The body, or None past MAX_FORM_BYTES (read no further: a 200 MB POST, refused
    afterwards, first took 400 MB)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    return bytes(body)


def _now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    now: datetime = row[0]
    return now
