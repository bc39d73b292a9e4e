"""What the user sees while a run goes: rank logs, the status line, reported metrics (chart, MLflow).

May import: driver.config, driver.result and what the driver may import; never driver.api,
driver.run or driver.spark (``driver-sublayers`` in pyproject.toml).
"""
