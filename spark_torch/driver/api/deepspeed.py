"""``DeepspeedTorchDistributor``: PySpark's DeepSpeed launcher on spark_torch (change the import).

::

    # from pyspark.ml.deepspeed.deepspeed_distributor import DeepspeedTorchDistributor
    from spark_torch import DeepspeedTorchDistributor

    DeepspeedTorchDistributor(numGpus=2, nnodes=2, localMode=False, useGpu=True,
                              deepspeedConfig={"train_batch_size": 32, ...}).run("train.py", "--epochs=3")

As in PySpark: ``numGpus * nnodes`` ranks; a script gets ``--deepspeed`` and, when a config is
given, ``--deepspeed_config PATH`` after its own arguments (a dict config is written to a JSON
file on every node: PATH is that file there); a function runs as it is, calling
``deepspeed.initialize`` itself. The Spark key that allows a cluster requiring TLS is
``deepspeed.spark.distributor.ignoreSsl``. Without GPUs (``useGpu=False``) the ranks get
``DS_ACCELERATOR=cpu`` unless it is set, so DeepSpeed uses its CPU accelerator (with gloo).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from spark_torch.base import envnames
from spark_torch.driver.api.distributor import run_entrypoint, without_internal_frames
from spark_torch.driver.api.torch_distributor import TorchDistributor
from spark_torch.driver.run.entrypoint import ScriptEntrypoint, make_entrypoint
from spark_torch.driver.spark.cluster import DEEPSPEED_IGNORE_SSL_KEY
from spark_torch.errors import ConfigurationError
from spark_torch.shared.spec import file_argument

__all__ = ["DeepspeedTorchDistributor"]

#: the name of a dict config's file on every node
CONFIG_FILE = "deepspeed_config.json"


class DeepspeedTorchDistributor(TorchDistributor):
    """PySpark's ``DeepspeedTorchDistributor`` interface, run by spark_torch.

    Args:
        numGpus: ranks per node (GPUs per node with GPUs).
        nnodes: nodes; ``numGpus * nnodes`` ranks in all.
        localMode: True runs every rank on the driver; False runs Spark barrier tasks.
        useGpu: use GPUs (default True, as in PySpark).
        deepspeedConfig: DeepSpeed's configuration: a dict, the path of a JSON file (which must
            exist at that path on every node), or None for DeepSpeed's defaults.
    """

    def __init__(
        self,
        numGpus: int = 1,  # noqa: N803 - PySpark's names
        nnodes: int = 1,
        localMode: bool = True,  # noqa: N803
        useGpu: bool = True,  # noqa: N803
        deepspeedConfig: str | os.PathLike[str] | Mapping[str, Any] | None = None,  # noqa: N803
    ) -> None:
        if deepspeedConfig is not None and not isinstance(deepspeedConfig, (str, os.PathLike, Mapping)):
            raise TypeError(
                f"deepspeedConfig must be a dict, the path of a JSON file, or None; got {deepspeedConfig!r}"
            )
        if isinstance(deepspeedConfig, Mapping):
            try:
                json.dumps(dict(deepspeedConfig))
            except (TypeError, ValueError) as exc:
                raise ConfigurationError(f"deepspeedConfig is not JSON ({exc})") from None
        self.deepspeed_config = deepspeedConfig
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} has to be a positive integer, got {value!r}")
        cpu = {} if useGpu or envnames.DS_ACCELERATOR in os.environ else {envnames.DS_ACCELERATOR: "cpu"}
        super().__init__(numGpus * nnodes, localMode, useGpu, _ssl_conf=DEEPSPEED_IGNORE_SSL_KEY, _env=cpu)
        self.cleanup_deepspeed_conf = False

    def _config_arguments(self) -> tuple[list[str], dict[str, bytes]]:
        """The arguments after the script's own, and the files the nodes write."""
        config = self.deepspeed_config
        if config is None:
            return ["--deepspeed"], {}
        if isinstance(config, Mapping):
            content = json.dumps(dict(config), indent=2).encode("utf-8")
            return ["--deepspeed", "--deepspeed_config", file_argument(CONFIG_FILE)], {CONFIG_FILE: content}
        return ["--deepspeed", "--deepspeed_config", os.path.abspath(os.fspath(config))], {}

    def run(self, main: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``main`` on every rank: a function (rank 0's result), or the path of a
        script, given ``--deepspeed [--deepspeed_config PATH]`` after ``args``."""
        try:
            entry = make_entrypoint(main, args, kwargs)
            if isinstance(entry, ScriptEntrypoint):
                extra, files = self._config_arguments()
                entry = ScriptEntrypoint(entry.path, (*entry.argv, *extra), files)
            return run_entrypoint(self._distributor, entry)
        except BaseException as error:  # every error leaves without spark_torch's frames
            without_internal_frames(error)
            raise
