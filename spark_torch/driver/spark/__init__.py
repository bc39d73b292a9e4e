"""Everything that talks to Spark: the session, the cluster's conf and slots, shipping the package, PySpark version shims, DataFrames, Java and executor checks.

May import: driver.config, driver.result and what the driver may import; never driver.api,
driver.run or driver.console (``driver-sublayers`` in pyproject.toml).
"""
