"""Storage errors that never quote a storage option (credentials, endpoints).

A filesystem backend may put an option it was given into an error: botocore quotes a bad
endpoint URL or signature version, an ``OSError`` carries a file name, an exception's
``__str__`` may read an attribute, a library may ``add_note``. Such an error would reach logs, the
user's traceback and the run's failure report. :func:`options_withheld` renders each error
raised inside it whole (:func:`traceback.format_exception`: its text, its notes, every cause and
context); when an option value shows anywhere, it raises instead a new exception of the same
type (an ``OSError`` when that type cannot be built from one message) whose message is the
rendered chain with each value replaced by ``***``, its notes likewise, and no cause or
context: nothing of the original, which still holds the values, travels on. An error that
quotes no option is re-raised unchanged. Standard library only.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["options_withheld", "withheld", "option_texts"]

#: option values shorter than this are not looked for in error texts (``"s3"``, ``"1"``...)
SHORTEST_HIDDEN = 4
#: what stands in for a value
MASK = "***"


def option_texts(options: Any) -> list[str]:
    """Every string in ``options`` (nested mappings and lists) worth hiding, as written and as
    ``repr`` escapes it (a value inside a quoted dict or list in a message), longest first."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                walk(item)
        elif isinstance(value, str) and len(value) >= SHORTEST_HIDDEN:
            found.update({value, repr(value)[1:-1]})

    walk(options)
    return sorted(found, key=len, reverse=True)


def _hide(text: str, values: list[str]) -> str:
    for value in values:
        text = text.replace(value, MASK)
    return text


def _rendered(exc: BaseException) -> str:
    """All a traceback of ``exc`` shows (chain and notes included), or what can be said when
    rendering fails (a ``__str__`` that raises)."""
    try:
        return "".join(traceback.format_exception(exc))
    except Exception:  # noqa: BLE001 - a broken __str__ somewhere in the chain
        return type(exc).__name__


def _text(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when its ``__str__`` fails."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__
        return "<its message cannot be printed>"


def _chain_text(exc: BaseException) -> str:
    """``exc``'s message, then its causes' as ``Type: message`` (outermost first), as a
    traceback would link them (notes and frames left out)."""
    parts = [_text(exc)]
    seen = {id(exc)}
    link = exc.__cause__ if exc.__cause__ is not None else (None if exc.__suppress_context__ else exc.__context__)
    while link is not None and id(link) not in seen and len(parts) < 8:
        seen.add(id(link))
        parts.append(f"{type(link).__name__}: {_text(link)}")
        link = link.__cause__ if link.__cause__ is not None else (None if link.__suppress_context__ else link.__context__)
    return " <- caused by ".join(parts)


def _notes(exc: BaseException) -> list[str]:
    notes = getattr(exc, "__notes__", None)
    return [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []


def _rebuilt(kind: type[BaseException], message: str, notes: list[str], values: list[str]) -> BaseException:
    """A new ``kind`` with ``message`` (else an OSError), provided its rendering quotes no value."""
    for make in (kind, OSError):
        try:
            clean = make(message)
            for note in notes:
                clean.add_note(note)
        except Exception:  # noqa: BLE001 - a type that takes other arguments
            continue
        text = _rendered(clean)
        if not any(value in text for value in values) and type(clean).__name__ in text:
            return clean
    return OSError(f"{kind.__name__} (its message quoted a storage option and is withheld)")


def withheld(exc: BaseException, options: Mapping[str, Any]) -> BaseException:
    """``exc`` itself when no value of ``options`` shows in its rendering; else a new exception
    with every value replaced by ``***``, its notes likewise, and no cause or context."""
    values = option_texts(options)
    if not values or not any(value in _rendered(exc) for value in values):
        return exc
    message = _hide(_chain_text(exc), values)
    return _rebuilt(type(exc), message, [_hide(n, values) for n in _notes(exc)], values)


@contextlib.contextmanager
def options_withheld(options: Mapping[str, Any]) -> Iterator[None]:
    """Errors raised inside never quote a value of ``options`` (:func:`withheld`). The clean
    error is raised outside the ``except`` block, so that not even its ``__context__`` holds the
    original."""
    clean: BaseException | None = None
    try:
        yield
    except Exception as exc:
        clean = withheld(exc, options)
        if clean is exc:
            raise
    if clean is not None:
        try:  # raised here, ``clean`` gets the original as its __context__ (the with statement's)
            raise clean
        except BaseException as again:  # noqa: BLE001 - cut that link, then re-raise as is
            again.__cause__, again.__context__, again.__suppress_context__ = None, None, True
            raise
