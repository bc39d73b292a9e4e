"""What a healing rank unpickles: torchft's ``PGTransport`` metadata only (:func:`loads`, :func:`install`).

torchft's ``PGTransport.recv_checkpoint`` unpickles the description of the state a peer group
sends (``pickle.loads``): the tree of the state dict, each tensor's shape and dtype, and every
leaf that is not a tensor. The sender is whoever the quorum named as the heal source, and nothing
authenticates it (docs/security.md): a pickle from anyone else could run code in the rank. In a
rank of a replica-group run, :func:`install` makes that module's unpickling accept only what such
a description holds: torchft's own metadata classes, the pytree classes, ``torch.Size``, torch's
dtypes and devices, and plain data (numbers, strings, bytes, None, lists, tuples, dicts, sets,
``OrderedDict``). Anything else is refused with :class:`HealRefused`, before it is built.
"""

from __future__ import annotations

import io
import pickle
from types import ModuleType, SimpleNamespace
from typing import Any

__all__ = ["HealRefused", "loads", "install", "ALLOWED"]

#: the globals a heal's description may name (module -> names); torch's dtypes are allowed too
ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset(
        {"dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes", "complex", "slice"}
    ),
    "collections": frozenset({"OrderedDict"}),
    "torch": frozenset({"Size", "device"}),
    "torch.utils._pytree": frozenset({"TreeSpec", "LeafSpec", "MappingKey", "SequenceKey", "GetAttrKey"}),
    "torchft.checkpointing.pg_transport": frozenset({"_StateDictMeta", "_TensorMeta"}),
}
#: set on the module torchft unpickles with, once installed
_MARK = "_spark_torch_safe_heal"


class HealRefused(pickle.UnpicklingError):
    """The state a peer group sent to heal this rank names something that is not plain data."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or (module == "torch" and _is_dtype(name)):
            return super().find_class(module, name)
        raise HealRefused(
            f"spark_torch refused to unpickle {module}.{name} in the state a peer group sent to heal this rank: a heal "
            "source is not authenticated (docs/security.md), so only tensors, numbers, strings, None, and lists, "
            "tuples and dicts of them may travel; keep other objects out of the Manager's state_dict (turn them "
            "into those)"
        )


def _is_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def loads(data: bytes) -> Any:
    """``pickle.loads`` of a heal's description, refusing anything but what :data:`ALLOWED` names."""
    return _Unpickler(io.BytesIO(data)).load()


def install(module: ModuleType) -> None:
    """Make ``module`` (torchft's ``checkpointing.pg_transport``) unpickle with :func:`loads`;
    its pickling is unchanged (idempotent)."""
    if getattr(module, _MARK, False):
        return
    module.pickle = SimpleNamespace(dumps=pickle.dumps, loads=loads)  # type: ignore[attr-defined]
    setattr(module, _MARK, True)
