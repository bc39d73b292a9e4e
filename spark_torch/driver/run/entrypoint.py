"""What to run on every rank: a Python function or a training script."""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_torch.errors import ArgumentError, ConfigurationError

__all__ = ["FunctionEntrypoint", "ScriptEntrypoint", "Entrypoint", "make_entrypoint", "check_arguments"]


@dataclass(frozen=True)
class FunctionEntrypoint:
    """``fn(*args, **kwargs)`` on every rank; rank 0's return value is the result."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def description(self) -> str:
        """A short human name, e.g. ``train`` or ``mymodule.train``."""
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        module = getattr(self.fn, "__module__", None)
        return name if module in (None, "__main__") else f"{module}.{name}"


@dataclass(frozen=True)
class ScriptEntrypoint:
    """``python SCRIPT ARGV...`` on every rank, like ``torchrun SCRIPT ARGV...``."""

    path: str
    argv: tuple[str, ...] = ()
    #: files for the nodes to write (see :data:`spark_torch.shared.spec.RunSpec.files`)
    files: Mapping[str, bytes] = field(default_factory=dict, repr=False)

    @property
    def description(self) -> str:
        """The script path."""
        return self.path


Entrypoint = FunctionEntrypoint | ScriptEntrypoint


def check_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Bind ``args``/``kwargs`` to ``fn``'s signature here, on the driver, as the ranks would call
    it: a mismatch is an :class:`ArgumentError` naming the function, its parameters and the closest
    one to a misspelt keyword, before any rank starts. A callable without a signature (some
    builtins) is not checked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        params = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        keywords = [
            p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        hints = [
            f"{name!r} (did you mean {close[0]!r}?)"
            for name in kwargs
            if name not in keywords and (close := difflib.get_close_matches(name, keywords, 1))
        ]
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        bare = signature.replace(  # the parameters as the user wrote them, without their annotations
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        reason = f"unexpected keyword argument {', '.join(hints)}" if hints else str(exc)
        raise ArgumentError(
            f"run({name}, ...): the arguments do not fit {name}{bare}: {reason}; "
            f"its parameters are {', '.join(params) or 'none'} (no rank was started)"
        ) from None


def make_entrypoint(main: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Entrypoint:
    """Decide once whether ``main`` is a function or a script path, and check it."""
    if callable(main):
        check_arguments(main, args, kwargs)
        return FunctionEntrypoint(main, tuple(args), dict(kwargs))
    if isinstance(main, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(main))
        if kwargs:
            raise ConfigurationError(
                f"keyword arguments {sorted(kwargs)} cannot be passed to a script ({path}); "
                "pass them as command-line arguments, e.g. run(path, '--lr=0.01')"
            )
        if not os.path.exists(path):
            raise FileNotFoundError(f"training script not found: {path}")
        if os.path.isdir(path):
            raise IsADirectoryError(f"training script {path} is a directory; pass the path of a .py file inside it")
        if not os.access(path, os.R_OK):
            raise PermissionError(f"training script {path} is not readable")
        return ScriptEntrypoint(path, tuple(str(a) for a in args))
    raise TypeError(f"main must be a function or the path of a training script, got {type(main).__name__}: {main!r}")
