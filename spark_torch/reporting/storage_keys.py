"""The pickling rule: a result holds a key to its storage options, never the options.

A :class:`~spark_torch.reporting.checkpoint.Checkpoint` of a run's storage (and so a
``RunResult``, a ``RunSummary``, anything that holds one) keeps a :class:`StorageKey` where it
would have kept the storage options (fsspec's keyword arguments: credentials, endpoints). The
options themselves stay in this module's registry, in this process's memory, for as long as an
object holds the key. What a pickle, ``copy``/``deepcopy``, ``dataclasses.asdict`` or ``vars()``
gives holds the key's random token and the options' top-level names, never a value.

Opening a checkpoint (:func:`resolve_options`) takes, in this order: the options passed to it;
the options of its key while the key lives in this process (the run's or ``from_path``'s own
checkpoint, or a copy or unpickled pickle of it in the same process); the environment variable
``SPARK_TORCH_STORAGE_OPTIONS`` (a JSON object, or ``@FILE``: what the ``spark-torch`` command
reads); fsspec's own configuration for the protocol (``FSSPEC_S3_KEY=...``, ``FSSPEC_S3='{...}'``).
A checkpoint whose run used options and that finds none of these is refused before anything is
sent to its storage, with a :class:`~spark_torch.errors.ConfigurationError` that says what to pass.
Standard library only (fsspec's configuration is read only when it is needed).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from spark_torch.base import envnames
from spark_torch.errors import ConfigurationError

__all__ = ["StorageKey", "remember", "restored_key", "resolve_options", "options_from_text"]

_lock = threading.Lock()
#: a live key -> the options it stands for (gone with the last object holding the key)
_OPTIONS: weakref.WeakKeyDictionary[StorageKey, dict[str, Any]] = weakref.WeakKeyDictionary()
#: a live key's token -> the key (an unpickled key finds the live one of its token)
_BY_TOKEN: weakref.WeakValueDictionary[str, StorageKey] = weakref.WeakValueDictionary()


class StorageKey:
    """Stands for the storage options a checkpoint is opened with, without holding them.

    Attributes:
        token: a random name of the options in this process's registry (not a secret: it
            opens nothing outside this process, where the registry is).
        names: the options' top-level names (``("client_kwargs", "key", "secret")``), for the
            message that asks for them again.
    """

    __slots__ = ("token", "names", "__weakref__")

    def __init__(self, token: str, names: tuple[str, ...]) -> None:
        self.token = token
        self.names = names

    def __reduce__(self) -> tuple[Any, tuple[str, tuple[str, ...]]]:
        return (restored_key, (self.token, self.names))

    def __copy__(self) -> StorageKey:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> StorageKey:
        return self  # a copy opens as the original does, for as long as the original's options live

    def __repr__(self) -> str:
        return f"StorageKey(names={list(self.names)})"

    def options(self) -> dict[str, Any] | None:
        """The options this key stands for, while it lives in this process; else None."""
        with _lock:
            found = _OPTIONS.get(self)
        return None if found is None else dict(found)


def remember(options: Mapping[str, Any] | None) -> StorageKey | None:
    """A new key for ``options``, kept in this process's registry while the key lives (None
    for no options)."""
    if not options:
        return None
    key = StorageKey(secrets.token_hex(16), tuple(sorted(str(k) for k in options)))
    with _lock:
        _OPTIONS[key] = dict(options)
        _BY_TOKEN[key.token] = key
    return key


def restored_key(token: str, names: tuple[str, ...]) -> StorageKey:
    """An unpickled :class:`StorageKey`: the live key of that token in this process, else one
    that stands for no options here (its checkpoint needs them given again)."""
    with _lock:
        live = _BY_TOKEN.get(token)
    return live if live is not None else StorageKey(token, tuple(names))


def options_from_text(text: str, source: str) -> dict[str, Any]:
    """A JSON object, or ``@FILE`` naming a file that holds one (``source`` names where the
    text came from). The text may hold credentials: an error says what is wrong with it, never
    what it is.

    Raises:
        ValueError: the file cannot be read, or the text is not a JSON object.
    """
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"{source}: cannot read {path} ({getattr(exc, 'strerror', None) or type(exc).__name__})"
            ) from None
        source = f"{source}: {path}"
    try:
        value = json.loads(text)
    except ValueError as exc:  # its message gives the position, never the text
        raise ValueError(
            f'{source} is not valid JSON ({exc}); give a JSON object like {{"anon": false}} or @FILE'
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f'{source} must be a JSON object (got a JSON {type(value).__name__}), like {{"anon": false}}')
    return value


def _fsspec_configured(url: str) -> bool:
    """Whether fsspec's own configuration (``FSSPEC_<PROTOCOL>...``, its config files) has
    options for ``url``'s protocol."""
    from fsspec.config import conf

    return bool(conf.get(url.split("://", 1)[0]))


def resolve_options(key: StorageKey | None, given: Mapping[str, Any] | None, url: str, how: str) -> dict[str, Any]:
    """The storage options to open ``url`` with (the order is the module's docstring's);
    ``how`` names the call that asked, for the error.

    Raises:
        ConfigurationError: the run used options, and none are given or known here.
    """
    if given is not None:
        return dict(given)
    live = key.options() if key is not None else None
    if live is not None:
        return live
    from_env = os.environ.get(envnames.STORAGE_OPTIONS)
    if from_env is not None:
        return options_from_text(from_env, envnames.STORAGE_OPTIONS)
    if key is None or _fsspec_configured(url):
        return {}
    names = ", ".join(f"{n!r}: ..." for n in key.names)
    raise ConfigurationError(
        f"{how}(): {url} is on storage that its run opened with storage_options, which a checkpoint does not "
        "keep (nothing a result pickles or copies holds a credential), and none are known in this "
        f"process; pass them again: {how}(storage_options={{{names}}}), or set "
        f"{envnames.STORAGE_OPTIONS} (a JSON object, or @FILE), or open the run again with "
        "RunResult.from_path(..., storage_options=...)"
    )
