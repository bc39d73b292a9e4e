"""``TorchDistributor``: PySpark's interface on spark_torch (change only the import).

::

    # from pyspark.ml.torch.distributor import TorchDistributor
    from spark_torch import TorchDistributor

    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 1e-3)

Same constructor (``num_processes=1, local_mode=True, use_gpu=True``, the private ``_ssl_conf``
accepted), the public attributes of PySpark 4's class (``num_processes``, ``local_mode``,
``use_gpu``, ``num_tasks``, ``spark``, ``ssl_conf``, ``logger``, ``is_remote``,
``is_spark_local_master``, ``input_params``, all set by the constructor), same
``run(main, *args, **kwargs)``, and the same exception types for the same misconfigurations (``RuntimeError`` for GPU
and encryption settings, ``ValueError``
for a bad ``num_processes``). Everything else is spark_torch's: live logs, rank 0's result,
errors naming the failing rank. :class:`~spark_torch.Distributor` stays the recommended class
(``use_gpu=None`` detects GPUs; more options); note that ``use_gpu`` defaults to ``True`` here,
as in PySpark, so on a CPU cluster pass ``use_gpu=False``. It is not a subclass of PySpark's
class (that would import pyspark.ml and run PySpark's launcher), and its private methods
(``_run``, ``_get_num_tasks``...) are not there.
"""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Mapping
from typing import Any

from spark_torch.driver.api.distributor import Distributor, without_internal_frames
from spark_torch.driver.run.plan import host_facts
from spark_torch.driver.spark.cluster import (
    DEEPSPEED_IGNORE_SSL_KEY,
    IGNORE_SSL_KEY,
    ClusterInfo,
    is_connect_session,
    is_local_master,
    master_of,
    read_cluster,
)
from spark_torch.errors import ClusterConfigurationError

__all__ = ["TorchDistributor"]

logger = logging.getLogger(__name__)


class TorchDistributor:
    """PySpark's ``TorchDistributor`` interface, run by spark_torch.

    Args:
        num_processes: number of ranks (a positive integer; numpy integers are accepted).
        local_mode: True runs every rank on the driver; False runs Spark barrier tasks.
        use_gpu: use GPUs (default True, as in PySpark: on CPU clusters pass False).
        _ssl_conf: the Spark conf key that allows running on a cluster that requires
            encryption (PySpark's private argument; only its default,
            ``pytorch.spark.distributor.ignoreSsl``, is read).
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        _ssl_conf: str = IGNORE_SSL_KEY,
        _env: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, numbers.Integral) or num_processes <= 0:
            raise ValueError(f"num_processes has to be a positive integer, got {num_processes!r}")
        if _ssl_conf not in (IGNORE_SSL_KEY, DEEPSPEED_IGNORE_SSL_KEY):
            logger.warning(
                "spark_torch: _ssl_conf=%r is accepted but only %s and %s are read",
                _ssl_conf,
                IGNORE_SSL_KEY,
                DEEPSPEED_IGNORE_SSL_KEY,
            )
        #: PySpark's attributes: a logger named after the class, whether the session is a Spark
        #: Connect client, whether its master runs every task in the driver
        self.logger = logging.getLogger(f"spark_torch.{type(self).__name__}")
        self.num_processes = int(num_processes)
        self.local_mode: bool = local_mode
        self.use_gpu: bool = use_gpu
        self.ssl_conf = _ssl_conf
        from spark_torch.driver.spark.session import active_session, get_or_create_session

        self.spark: Any = active_session() if local_mode else get_or_create_session()
        self.is_remote = self.spark is not None and is_connect_session(self.spark)
        self.is_spark_local_master = self.spark is not None and is_local_master(master_of(self.spark))
        self._distributor: Distributor = Distributor(
            self.num_processes, local_mode, use_gpu, spark=self.spark, env=_env
        )
        try:
            plan = self._distributor.plan()  # GPU and encryption settings are checked here, as PySpark does
        except ClusterConfigurationError:
            available = self._driver_gpus() if local_mode and use_gpu else 0
            if not 0 < available < self.num_processes:
                raise
            # PySpark's behaviour: fewer driver GPUs than processes in local mode is a warning
            logger.warning(
                "spark_torch: num_processes=%d is more than the driver's %d GPU(s); num_processes was reset to %d",
                self.num_processes,
                available,
                available,
            )
            self.num_processes = available
            self._distributor = Distributor(available, local_mode, use_gpu, spark=self.spark, env=_env)
            plan = self._distributor.plan()
        self.num_tasks = self.num_processes if local_mode else plan.num_nodes
        #: the public settings of this distributor (num_processes, local_mode, use_gpu,
        #: num_tasks, and a subclass's own), set here, as PySpark sets them
        self.input_params: dict[str, Any] = self._input_params()

    def _driver_gpus(self) -> int:
        cluster = read_cluster(self.spark) if self.spark is not None else ClusterInfo()
        if cluster.driver_gpu_amount > 0 and cluster.driver_gpu_addresses:
            return len(cluster.driver_gpu_addresses)
        return len(host_facts(self.local_mode, self.use_gpu, cluster, os.environ).gpus_found)

    def _input_params(self) -> dict[str, Any]:
        hidden = ("spark", "ssl_conf", "logger", "is_remote", "is_spark_local_master", "input_params")
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k not in hidden}

    def run(self, main: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``main`` (a function, or the path of a script) on every rank; rank 0's result."""
        try:
            return self._distributor.run(main, *args, **kwargs)
        except BaseException as error:  # every error leaves without spark_torch's frames
            without_internal_frames(error)
            raise
