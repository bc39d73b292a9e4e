"""What rank, node and driver share: the contracts between them and the logic more than one of
them runs (never pyspark; torch only on first use).

Holds: the run's specification (:mod:`~spark_torch.shared.spec`), the node <-> rank files
(:mod:`~spark_torch.shared.workdir_files` names them, :mod:`~spark_torch.shared.rank_files`
reads and writes the result and error files, :mod:`~spark_torch.shared.column_files` the
DataFrame rows), a node's end (:mod:`~spark_torch.shared.node_outcome`) and its one seal
(:mod:`~spark_torch.shared.sealed`), grouped
stacks and the stall decision (:mod:`~spark_torch.shared.stacks`), Flight Recorder dumps
(:mod:`~spark_torch.shared.fr_dumps`), log lines (:mod:`~spark_torch.shared.lines`), files
opened only if they are the user's own (:mod:`~spark_torch.shared.owned_files`) and torch's
store bound to one address (:mod:`~spark_torch.shared.bound_store`).
May import: :mod:`spark_torch.settings`, :mod:`spark_torch.errors`, :mod:`spark_torch.base` and
each other.
"""
