"""torchft's ``Manager`` wired to the run in every rank of a replica-group run, however it is made.

A script written for torchft builds its own ``torchft.Manager(pg=..., min_replica_size=1,
load_state_dict=..., state_dict=..., replica_id=...)`` from torchrun's variables, as torchft's
examples do. In a rank of a run with replica groups, :func:`install` (called by the rank's start-up
code, before the user's) puts a finder on ``sys.meta_path`` that wraps ``Manager.__init__`` when
``torchft.manager`` is first imported (at once when it already is), so that such a Manager gets
what :func:`spark_torch.ft.manager` gives (:func:`wire`): the fix to torchft's DDP hook
(:mod:`spark_torch.ft.ddp_fix`), its server bound to the node's address (``MASTER_ADDR``; torchft
binds every interface) and advertised there, healing over its process group (torchft's
``PGTransport``; torchft's default is an HTTP server on every interface) that unpickles plain data
only (:mod:`spark_torch.ft.safe_heal`), the group's replica id
when none is given, :func:`spark_torch.report`'s step following the Manager's, and in a DataFrame run
the count of the steps each group missed (:mod:`spark_torch.ft.data_position`). What the caller
passes wins. Nothing is imported before the user's code imports torchft: the hook costs a rank
without torchft nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from spark_torch.base.envnames import MASTER_ADDR, REPLICA_GROUP_ID

__all__ = ["install", "wire", "filled", "bind_address", "replica_id", "MODULE"]

#: the module that defines torchft's Manager
MODULE = "torchft.manager"
#: set on a wrapped ``__init__`` (wrapping twice would wire twice)
_MARK = "_spark_torch_wired"


def bind_address(host: str, port: int = 0) -> str:
    """``host:port`` for a torchft server (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def replica_id(group: int) -> str:
    """The replica id of a group: torchft takes the trailing digits as the group's index."""
    return f"spark_torch_group_{group}"


def filled(given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The keywords a Manager of this rank gets that the caller left out (pure, but for making
    ``PGTransport``: see :func:`_transport`): the node's address as the advertised host name and
    the group's replica id. The checkpoint transport is added by the wrapper (it needs the
    process group)."""
    extra: dict[str, Any] = {}
    if given.get("hostname") is None and environ.get(MASTER_ADDR):
        extra["hostname"] = environ[MASTER_ADDR]
    if not given.get("replica_id") and environ.get(REPLICA_GROUP_ID, "").isdigit():
        extra["replica_id"] = replica_id(int(environ[REPLICA_GROUP_ID]))
    return extra


def _transport(pg: Any, timeout: Any) -> Any:
    """torchft's ``PGTransport`` over ``pg`` (on the GPU for NCCL), healing over the Manager's
    process group instead of torchft's HTTP server on every interface."""
    import torch
    import torchft
    from torchft.checkpointing.pg_transport import PGTransport

    on_gpu = isinstance(pg, getattr(torchft, "ProcessGroupNCCL", ())) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return PGTransport(pg, timeout=timeout, device=device)


@contextmanager
def _servers_bound_to(module: ModuleType, host: str) -> Iterator[None]:
    """torchft's Manager binds its server to ``[::]`` (every interface); bind it to ``host``."""
    original = getattr(module, "ManagerServer")  # noqa: B009 - a module mypy does not know

    def bound(**kwargs: Any) -> Any:
        port = int(str(kwargs["bind"]).rsplit(":", 1)[1])
        return original(**{**kwargs, "bind": bind_address(host, port)})

    setattr(module, "ManagerServer", bound)  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "ManagerServer", original)  # noqa: B010


def wire(module: ModuleType, environ: Mapping[str, str] = os.environ) -> None:
    """Wrap ``module.Manager.__init__`` (``module`` is ``torchft.manager``) as the module's
    docstring says (idempotent)."""
    manager_class = module.Manager
    original: Callable[..., None] = manager_class.__init__
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - it replaces __init__
        from spark_torch.ft import ddp_fix
        from spark_torch.reporting.api import follow_steps

        bound = signature.bind_partial(self, *args, **kwargs)
        given = dict(bound.arguments)
        given.pop("self", None)
        options = {**filled(given, environ), **given}
        if options.get("checkpoint_transport") is None and options.get("pg") is not None:
            timeout = options.get("timeout", signature.parameters["timeout"].default)
            options["checkpoint_transport"] = _transport(options["pg"], timeout)
        ddp_fix.install()
        import torchft.checkpointing.pg_transport as pg_transport

        from spark_torch.ft import safe_heal

        safe_heal.install(pg_transport)  # a heal unpickles plain data only: its source is not authenticated
        host = environ.get(MASTER_ADDR)
        if host:
            with _servers_bound_to(module, host):
                original(self, **options)
        else:
            original(self, **options)
        follow_steps(self.current_step)  # report() records torchft's committed step: no step twice
        from spark_torch.ft import data_position

        data_position.attach(self, environ)  # a DataFrame run: which group trained each step

    setattr(__init__, _MARK, True)
    __init__.__doc__, __init__.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
    manager_class.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``torchft.manager`` as the other finders do and wires its Manager once it ran."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        made: ModuleType | None = self.inner.create_module(spec)
        return made

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        wire(module)


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """In a rank of a replica-group run (``REPLICA_GROUP_ID`` set), wire torchft's Manager when it
    is imported (at once when it already is). Whether it did; idempotent."""
    if not environ.get(REPLICA_GROUP_ID):
        return False
    loaded = sys.modules.get(MODULE)
    if loaded is not None and hasattr(loaded, "Manager"):
        wire(loaded, environ)
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
