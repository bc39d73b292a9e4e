"""The rank layer: code that runs inside a rank process (never imports pyspark).

Owns: the rank entry modules (``python -m spark_torch.rank.function_main`` / ``script_main``),
how a rank ends (:mod:`~spark_torch.rank.shutdown`), its parent-death signal, the DataFrame
rows of a rank (:mod:`spark_torch.data`), and Ray Train's conveniences
(:mod:`~spark_torch.rank.prepare`: ``init_process_group``, ``prepare_model``,
``prepare_data_loader``). The environment contract is in :mod:`spark_torch.rank.function_main`.
May import: :mod:`spark_torch.ft` (a replica-group rank's start-up wires torchft's Manager),
:mod:`spark_torch.reporting` and the shared top-level modules only.
"""
