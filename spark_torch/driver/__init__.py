"""The driver layer: everything that runs in the user's process when ``run()`` is called.

Owns: the :class:`~spark_torch.Distributor` facade, options and planning, the Spark session and
conf snapshot, launching an attempt (local: the node runner in-process; distributed: the barrier
stage), the driver's log sink, status line and report tracker, and turning outcomes into errors.
May import: :mod:`spark_torch.node`, :mod:`spark_torch.ft`, :mod:`spark_torch.channel`,
:mod:`spark_torch.reporting` and the shared top-level modules; never :mod:`spark_torch.rank`.
"""
