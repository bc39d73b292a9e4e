"""One run on the driver: the controller and its attempts, membership, the restart policy, stall detection, local and
barrier attempts, planning, payload, failures into exceptions.

May import: the driver's lower sub-layers (spark_torch.driver.spark, spark_torch.driver.console,
spark_torch.driver.run_record, spark_torch.driver.result, spark_torch.driver.attempts,
spark_torch.driver.config) and what spark_torch.driver may import; never spark_torch.driver.api
(``driver-sublayers`` in pyproject.toml).
"""
