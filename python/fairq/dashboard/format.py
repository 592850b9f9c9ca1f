"""How the templates show numbers, ages, times and pauses (Jinja2 filters)."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote

from fairq.dashboard.queries import Pause

__all__ = ["FILTERS", "age", "count", "form_name", "from_form", "pause", "rate", "relative",
           "shown"]

# Unicode categories of the characters a name may hold that print nothing, pass for
# another or reorder the text around them: controls, format characters (zero-width
# spaces, bidi overrides and isolates), private and unassigned code points, and
# separators (every space but the plain one).
_UNSEEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


def count(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def age(seconds: float | None) -> str:
    """A duration for people: 850 ms, 12.3 s, 4 min 05 s, 2 h 07 min."""
    if seconds is None:
        return "—"
    if seconds < 0:
        return "-" + age(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def relative(at: datetime | None, now: datetime) -> str:
    """A moment relative to now: "now", "in 3.0 s", "2.0 s ago"."""
    if at is None:
        return "—"
    delta = (at - now).total_seconds()
    if abs(delta) < 0.05:
        return "now"
    return f"in {age(delta)}" if delta > 0 else f"{age(-delta)} ago"


def pause(value: Pause) -> str:
    if value.forever:
        return "until resumed"
    if value.until is not None:
        return f"until {value.until:%Y-%m-%d %H:%M:%S %Z}".strip()
    return "—"


def rate(release_interval_ms: int) -> str:
    return f"1 per {age(release_interval_ms / 1000)}" if release_interval_ms else "—"


def form_name(name: str) -> str:
    """A queue or channel name for a hidden form field, percent-encoded (the action
    decodes it: :func:`from_form`). As plain text a CR or LF in a name came back as
    CRLF (HTML reads CR as LF, a form sends LF as CRLF): Pause acted on another name."""
    return quote(name, safe="")


def from_form(value: str) -> str:
    """The name a form sent (:func:`form_name`); ValueError if its bytes are not UTF-8
    (replaced, they paused a channel of another name, made on the spot)."""
    return unquote(value, errors="strict")


def shown(name: str) -> str:
    """A queue or channel name as an operator must read it, tenants having chosen it:
    each character that prints nothing, passes for another or reorders the text around
    it as its escape (``\\u200b``, ``\\x0d``), and a backslash doubled. Names that
    differ in such characters never look alike (a zero-width space made a twin of a
    channel, whose Pause acted on the twin), and none spills into the text after it
    (U+202E reversed the notice that followed a name). Letters that resemble others
    (a Cyrillic "a" for a Latin one) are shown as they are."""
    return "".join(_shown_character(character) for character in name)


def _shown_character(character: str) -> str:
    if character == "\\":
        return "\\\\"
    if character == " " or unicodedata.category(character) not in _UNSEEN:
        return character
    code = ord(character)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


FILTERS: dict[str, Callable[..., Any]] = {
    "count": count, "age": age, "relative": relative, "pause": pause, "rate": rate,
    "form_name": form_name, "shown": shown}
