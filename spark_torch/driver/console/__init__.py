"""What the user sees while a run goes: rank logs, the status line, reported metrics (chart, MLflow).

May import: spark_torch.driver.config, spark_torch.driver.run_record, spark_torch.driver.result,
spark_torch.driver.attempts and what spark_torch.driver may import; never spark_torch.driver.api,
spark_torch.driver.run or spark_torch.driver.spark (``driver-sublayers`` in pyproject.toml).
"""
