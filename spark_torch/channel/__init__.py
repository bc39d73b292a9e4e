"""The channel layer: the authenticated connection between the driver and every node of a run.

Owns, one layer per module: framing and authentication (:mod:`~spark_torch.channel.wire`),
reliable delivery (:mod:`~spark_torch.channel.transport`), rank output
(:mod:`~spark_torch.channel.log_stream`), the rendezvous (:mod:`~spark_torch.channel.rendezvous`),
every message either end says (:mod:`~spark_torch.channel.messages`) and the two ends
(:mod:`~spark_torch.channel.driver_end`, :mod:`~spark_torch.channel.node_end`).
May import: the shared top-level modules only; what arrives is handed to objects that satisfy
its protocols, so it never imports the classes it serves (of spark_torch.driver, spark_torch.node,
spark_torch.reporting).
"""
