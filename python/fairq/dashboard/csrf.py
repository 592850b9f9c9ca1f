"""Protection of the dashboard's state-changing requests against cross-site requests.

Two checks, both required on every POST (the "signed double-submit cookie" and the
origin check of OWASP's CSRF cheat sheet):

- a token: each browser gets a random session id in a cookie (HttpOnly,
  SameSite=Strict); every form carries HMAC(secret, session id) in a hidden field. A
  page of another site can make the browser send the cookie but can neither read it
  nor compute the token: the secret is random per dashboard process (a restart only
  means reloading the page);
- the origin: the request's ``Origin`` (or, without one, its ``Referer``) must be this
  dashboard's own, and ``Sec-Fetch-Site``, when the browser sends it, must not say
  cross-site.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["COOKIE", "FIELD", "Csrf"]

COOKIE = "fairq_session"
FIELD = "csrf_token"


@dataclass(frozen=True)
class Csrf:
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def token(self, session: str) -> str:
        # Each use of the secret signs its own kind of text (b"session:", b"notice:"): a
        # session cookie a browser was made to carry, say "notice:<text>", must not
        # yield a notice's signature as its token, nor a signed notice a token.
        return hmac.new(self.secret, b"session:" + session.encode(), hashlib.sha256).hexdigest()

    def notice_signature(self, notice: str) -> str:
        """Signs the notice an action's redirect carries, so that a page shows only
        notices this dashboard wrote (a link with any ?notice= put its text on the
        page as the dashboard's own message)."""
        return hmac.new(self.secret, b"notice:" + notice.encode(), hashlib.sha256).hexdigest()

    def signed_notice(self, notice: str | None, signature: str | None) -> str | None:
        """``notice`` if ``signature`` is this dashboard's for it, else None."""
        if notice is None or signature is None:
            return None
        return notice if hmac.compare_digest(signature, self.notice_signature(notice)) else None

    def session(self, request: Request) -> tuple[str, bool]:
        """The browser's session id, and whether it is new (to be set as a cookie)."""
        existing = request.cookies.get(COOKIE)
        if existing and len(existing) >= 32:
            return existing, False
        return secrets.token_urlsafe(32), True

    def set_cookie(self, response: Response, session: str) -> None:
        response.set_cookie(COOKIE, session, httponly=True, samesite="strict", path="/")

    def origin_refusal(self, request: Request, origins: tuple[str, ...] = ()) -> str | None:
        """Why this POST is refused by its headers alone (checked before its body is
        read), or None. ``origins``: those accepted besides the address the request
        came to (a proxy's public one)."""
        if request.headers.get("sec-fetch-site", "same-origin") not in (
                "same-origin", "none"):
            return "cross-site request refused (Sec-Fetch-Site)"
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        origin = request.headers.get("origin")
        if origin is None:
            referer = urlsplit(request.headers.get("referer", ""))
            origin = f"{referer.scheme}://{referer.netloc}" if referer.netloc else None
        if origin != own and origin not in origins:
            return f"request from another origin refused ({origin or 'no Origin or Referer'})"
        return None

    def token_refusal(self, request: Request, form: dict[str, str]) -> str | None:
        """Why this POST's form is refused (no token, or not this browser's), or None."""
        session = request.cookies.get(COOKIE)
        sent = form.get(FIELD, "")
        if not session or not hmac.compare_digest(sent, self.token(session)):
            return "missing or wrong CSRF token (reload the page and try again)"
        return None
