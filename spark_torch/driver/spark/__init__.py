"""Everything that talks to Spark: the session, the cluster's conf and slots, shipping the package, PySpark version
shims, DataFrames, Java and executor checks.

May import: spark_torch.driver.config, spark_torch.driver.result, spark_torch.driver.attempts and
what spark_torch.driver may import; never spark_torch.driver.api, spark_torch.driver.run or
spark_torch.driver.console (``driver-sublayers`` in pyproject.toml).
"""
