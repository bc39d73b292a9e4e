"""The node layer: one node of a run (the driver in local mode, a Spark barrier task otherwise).

Owns: the node runner (staging, rendezvous, the rank environment, starting and watching the
node's ranks, cleanup), rank processes and their process trees, warm starts (the template),
the hosted rendezvous store, the reaper, and rank 0's result delivery.
May import: :mod:`spark_torch.ft` (a node's relay to the run's torchft lighthouse),
:mod:`spark_torch.channel`, :mod:`spark_torch.reporting` and the shared top-level modules, and in the warm-start
template's server only (so that every fork starts with them) the
ranks' entry modules :mod:`spark_torch.rank.function_main` and :mod:`spark_torch.rank.script_main`;
never :mod:`spark_torch.driver`. Every other module starts ranks by module name.
"""
