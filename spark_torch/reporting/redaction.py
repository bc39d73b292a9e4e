"""Storage errors that never quote a storage option (credentials, endpoints).

A filesystem backend may put an option it was given into an error: botocore quotes a bad
endpoint URL or signature version, an ``OSError`` carries a file name, an exception's
``__str__`` may read an attribute, a library may ``add_note``. Such an error would reach logs, the
user's traceback and the run's failure report; an error whose ``__str__`` hides its arguments
still holds them in its ``repr()``, its attributes (an HTTP error's request headers) and its
pickle, which a rank's error report sends to the driver. :func:`options_withheld` looks at each
error raised inside it whole: its rendering (:func:`traceback.format_exception`: its text, its
notes, every cause and context) and, for it and every exception linked to it, its ``repr()``,
its attributes (nested containers and objects, a few levels deep) and its pickle. Each value is
looked for as written, as ``repr`` escapes it and URL-quoted (``%2F``, ``+``). When a value
shows anywhere, it raises instead a new exception of the same type (an ``OSError`` when that
type cannot be built from one message) whose message is the chain's text with each value
replaced by ``***``, its notes likewise, and no cause, context or attribute of the original:
nothing of the original, which still holds the values, travels on (its pickle is dropped, its
text kept). An error that holds no option is re-raised unchanged. Standard library only.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import traceback
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote, quote_plus

__all__ = ["options_withheld", "withheld", "option_texts"]

#: option values shorter than this are not looked for in error texts (``"s3"``, ``"1"``...)
SHORTEST_HIDDEN = 4
#: what stands in for a value
MASK = "***"


def _forms(value: str) -> set[str]:
    """``value`` as written, as ``repr`` escapes it (inside a quoted dict or list in a message)
    and URL-quoted (a path or query: ``%2F`` and ``%2f``, ``+`` for a space)."""
    forms = {value, repr(value)[1:-1]}
    for quoted in (quote(value, safe=""), quote(value), quote_plus(value)):
        forms.update({quoted, re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), quoted)})
    return forms


def option_texts(options: Any) -> list[str]:
    """Every string in ``options`` (nested mappings and lists) worth hiding, in each form it may
    take in an error (:func:`_forms`), longest first."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                walk(item)
        elif isinstance(value, str) and len(value) >= SHORTEST_HIDDEN:
            found.update(_forms(value))

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
        link = (
            link.__cause__ if link.__cause__ is not None else (None if link.__suppress_context__ else link.__context__)
        )
    return " <- caused by ".join(parts)


def _notes(exc: BaseException) -> list[str]:
    notes = getattr(exc, "__notes__", None)
    return [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []


#: how deep :func:`_held_texts` looks into an exception's attributes, and at most how many
_DEPTH, _MOST = 4, 2000


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ shows nothing
        return ""


def _linked(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception reachable from it (causes, contexts, a group's members)."""
    found: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo and len(found) < 64:
        link = todo.pop()
        if not isinstance(link, BaseException) or any(link is f for f in found):
            continue
        found.append(link)
        todo += [link.__cause__, link.__context__, *getattr(link, "exceptions", ())]
    return found


def _held_texts(exc: BaseException) -> list[str]:
    """What ``exc`` holds as text: its repr, its args' and attributes' (strings, bytes, nested
    containers and objects' ``__dict__``, a few levels deep, each object's repr too)."""
    texts = [_safe_repr(exc)]
    todo: list[tuple[Any, int]] = [(exc.args, 0), (getattr(exc, "__dict__", {}), 0)]
    seen: set[int] = set()
    while todo and len(seen) < _MOST:
        value, depth = todo.pop()
        if id(value) in seen or depth > _DEPTH:
            continue
        seen.add(id(value))
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, (bytes, bytearray)):
            texts.append(bytes(value).decode("utf-8", errors="replace"))
        elif isinstance(value, Mapping):
            todo += [(item, depth + 1) for pair in list(value.items()) for item in pair]
        elif isinstance(value, (list, tuple, set, frozenset)):
            todo += [(item, depth + 1) for item in list(value)]
        elif not isinstance(value, (int, float, bool, type(None), BaseException)):
            texts.append(_safe_repr(value))
            todo.append((getattr(value, "__dict__", None), depth + 1))
    return texts


def _pickled(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - what does not pickle does not travel pickled
        return b""


def _exposed(exc: BaseException, values: list[str]) -> bool:
    """Whether any of ``values`` shows in what ``exc`` renders, holds or pickles to."""
    rendered = _rendered(exc)
    if any(value in rendered for value in values):
        return True
    for link in _linked(exc):
        texts = _held_texts(link)
        if any(value in text for text in texts for value in values):
            return True
        pickled = _pickled(link)
        if any(value.encode("utf-8") in pickled for value in values):
            return True
    return False


def _rebuilt(kind: type[BaseException], message: str, notes: list[str], values: list[str]) -> BaseException:
    """A new ``kind`` with ``message`` (else an OSError), provided its rendering quotes no value."""
    for make in (kind, OSError):
        try:
            clean = make(message)
            for note in notes:
                clean.add_note(note)
        except Exception:  # noqa: BLE001 - a type that takes other arguments
            continue
        if not _exposed(clean, values) and type(clean).__name__ in _rendered(clean):
            return clean
    return OSError(f"{kind.__name__} (its message quoted a storage option and is withheld)")


def withheld(exc: BaseException, options: Mapping[str, Any]) -> BaseException:
    """``exc`` itself when no value of ``options`` shows in what it renders, holds or pickles
    to; else a new exception with every value replaced by ``***`` in its text, its notes
    likewise, and no cause, context or attribute of the original."""
    values = option_texts(options)
    if not values or not _exposed(exc, values):
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
