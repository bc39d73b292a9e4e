"""How to install torchft where a replica group's ranks run: the one install hint of
``replica_groups``, read from spark_torch's own ``[ft]`` extra (pure but for that read)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["MODULE", "REQUIREMENT", "requirement", "install_hint"]

#: what a rank imports
MODULE = "torchft"
#: the ``[ft]`` extra's requirement when spark_torch's metadata cannot be read (a source tree on sys.path)
REQUIREMENT = "torchft>=0.2.0"


def requirement(requires: list[str] | None = None) -> str:
    """torchft's requirement in the ``[ft]`` extra: from ``requires`` (default: the installed
    spark-torch's metadata, from a checkout installed with ``pip install -e`` or from a wheel)."""
    if requires is None:
        try:
            requires = metadata.requires("spark-torch") or []
        except metadata.PackageNotFoundError:
            requires = []
    for line in requires:
        spec, _, marker = line.partition(";")
        if spec.strip().startswith(MODULE) and "extra" in marker and "ft" in marker.replace("'", '"').split('"'):
            return "".join(spec.split())
    return REQUIREMENT


def install_hint() -> str:
    """The command that installs torchft, and where (spark-torch is not on PyPI: its ``[ft]``
    extra works only from a checkout or a wheel)."""
    return (
        f"pip install '{requirement()}' into the Python of the driver and of the executors (the [ft] extra: "
        "pip install '.[ft]' from a checkout, or 'spark_torch-VERSION-py3-none-any.whl[ft]' from a wheel)"
    )
