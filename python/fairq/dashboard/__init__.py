"""``fairq dashboard``: a live web view of the queues, and their Prometheus metrics.

Needs the optional extra: ``pip install 'fairq[dashboard]'`` (Starlette, uvicorn,
Jinja2, prometheus_client). Modules: ``queries`` (every SQL statement and its rows),
``sampler`` (the queues read every few seconds, and the counters of the history),
``charts`` (the last hour as SVG data), ``metrics`` (the Prometheus exposition),
``csrf`` (the POSTs' protection), ``format`` (the templates' filters), ``app`` (pages
and actions), ``server`` (uvicorn), ``cli`` (``fairq dashboard``) and ``exporter``
(``fairq metrics``); ``templates/`` and ``static/`` ship in the wheel.
"""

from fairq.dashboard.cli import main

__all__ = ["main"]
