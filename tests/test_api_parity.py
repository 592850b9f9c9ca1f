"""``Queue`` and ``AsyncQueue`` offer the same calls, and so do ``Message`` and
``AsyncMessage``: the same public names, and for each the same parameters (names,
kinds, defaults, annotations) and the same result, which the async binding gives as a
coroutine (or, for ``connection()`` and ``transaction()``, an async context manager).

Annotations are compared as written (the package uses ``from __future__ import
annotations``): the async binding's as they are, the sync binding's with each sync
type named by its async twin (``Connection`` is ``AsyncConnection``, ``Iterator`` is
``AsyncIterator``, ...), so an async call that names a sync type differs. No database
needed.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import pytest

from fairq import AsyncMessage, AsyncQueue, Message, Queue

# What the async binding calls the sync binding's types, longest names first.
ASYNC_TYPES = ("AsyncConnectionPool", "AsyncConnection", "AsyncIterator", "AsyncMessage",
               "AsyncQueue")
# The protocol methods that carry the same call under another name.
ASYNC_NAMES = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
PAIRS = {"Queue": (Queue, AsyncQueue), "Message": (Message, AsyncMessage)}

Shape = tuple[list[tuple[str, Any, Any, Any]], Any]


def as_async(annotation: Any) -> Any:
    """A sync binding's annotation in async terms."""
    if not isinstance(annotation, str):
        return annotation  # inspect.Parameter.empty
    for name in ASYNC_TYPES:
        annotation = re.sub(rf"\b{name.removeprefix('Async')}\b", name, annotation)
    return annotation


def as_written(annotation: Any) -> Any:
    return annotation


def shape(function: Callable[..., Any], terms: Callable[[Any], Any] = as_written) -> Shape:
    """Parameters (name, kind, default, annotation) and result, the annotations in
    ``terms`` (as_async for the sync binding)."""
    signature = inspect.signature(function)
    parameters = [(p.name, p.kind, p.default, terms(p.annotation))
                  for p in signature.parameters.values()]
    return parameters, terms(signature.return_annotation)


def overload_shapes(function: Callable[..., Any],
                    terms: Callable[[Any], Any] = as_written) -> list[Shape]:
    # typing.get_overloads exists from Python 3.11 on; before, only the implementation
    # is compared.
    get_overloads = getattr(typing, "get_overloads", None)
    return [] if get_overloads is None else [shape(o, terms) for o in get_overloads(function)]


def flavour(function: Callable[..., Any]) -> str:
    """What calling it gives: a result, a coroutine, or a context manager (the
    generator under ``@contextmanager`` / ``@asynccontextmanager``)."""
    body = inspect.unwrap(function)
    if inspect.iscoroutinefunction(body):
        return "coroutine"
    if inspect.isasyncgenfunction(body):
        return "async context manager"
    if inspect.isgeneratorfunction(body):
        return "context manager"
    return "result"


ASYNC_FLAVOUR = {"result": "coroutine", "context manager": "async context manager"}


def public_calls(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods, the constructor, and the (async) context manager protocol,
    by their sync names."""
    names = [n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))]
    calls = {name: getattr(cls, name) for name in names}
    calls["__init__"] = cls.__init__
    for sync_name, async_name in ASYNC_NAMES.items():
        for name in (sync_name, async_name):
            if name in vars(cls):
                calls[sync_name] = getattr(cls, name)
    return calls


def call_names() -> list[tuple[str, str]]:
    return [(pair, name) for pair, classes in PAIRS.items()
            for name in sorted(set().union(*(public_calls(c) for c in classes)))]


@pytest.mark.parametrize("pair", PAIRS)
def test_both_bindings_offer_the_same_calls(pair: str) -> None:
    sync, async_ = (public_calls(cls) for cls in PAIRS[pair])
    assert sorted(sync) == sorted(async_), (
        f"only sync: {sorted(sync.keys() - async_.keys())},"
        f" only async: {sorted(async_.keys() - sync.keys())}")


@pytest.mark.parametrize(("pair", "name"), call_names())
def test_each_call_has_the_same_signature_in_both_bindings(pair: str, name: str) -> None:
    sync_cls, async_cls = PAIRS[pair]
    sync, async_ = public_calls(sync_cls).get(name), public_calls(async_cls).get(name)
    if sync is None or async_ is None:
        pytest.skip("offered by one binding only: test_both_bindings_offer_the_same_calls")
    assert shape(async_) == shape(sync, as_async)
    assert overload_shapes(async_) == overload_shapes(sync, as_async)
    if name == "__init__":
        assert flavour(async_) == flavour(sync) == "result"
    else:
        assert flavour(async_) == ASYNC_FLAVOUR[flavour(sync)]


def test_the_comparison_sees_differences() -> None:
    """The helpers above tell apart what a binding could get wrong."""

    class Sync:
        def call(self, a: int, *, b: str | None = None) -> list[Message[Any]]: ...

    class Async:
        async def call(self, a: int, *, b: str | None = None) -> list[AsyncMessage[Any]]: ...

    class WrongDefault:
        async def call(self, a: int, *, b: str | None = "") -> list[AsyncMessage[Any]]: ...

    class WrongKind:
        async def call(self, a: int, b: str | None = None) -> list[AsyncMessage[Any]]: ...

    class WrongResult:
        async def call(self, a: int, *, b: str | None = None) -> list[Message[Any]] | None: ...

    class NamesASyncType:
        async def call(self, a: int, *, b: str | None = None) -> list[Message[Any]]: ...

    class NotACoroutine:
        def call(self, a: int, *, b: str | None = None) -> list[AsyncMessage[Any]]: ...

    assert shape(Async.call) == shape(Sync.call, as_async)
    assert flavour(Async.call) == ASYNC_FLAVOUR[flavour(Sync.call)]
    for wrong in (WrongDefault, WrongKind, WrongResult, NamesASyncType):
        assert shape(wrong.call) != shape(Sync.call, as_async), wrong.__name__
    assert flavour(NotACoroutine.call) != ASYNC_FLAVOUR[flavour(Sync.call)]
