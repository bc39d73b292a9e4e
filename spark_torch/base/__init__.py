"""The bottom of spark_torch: the names and small pieces every layer shares, importing nothing of
spark_torch's own (and neither pyspark nor torch).

Holds: every environment variable's name (:mod:`~spark_torch.base.envnames`), the states and
their shared str-enum base (:mod:`~spark_torch.base.states`), the grace periods between SIGTERM
and SIGKILL and the waits derived from them (:mod:`~spark_torch.base.grace`), and the
thread-with-a-deadline helper (:mod:`~spark_torch.base.background`).
May import: the standard library only.
"""
