"""What the user sees while a run goes: rank logs, the status line, reported metrics (chart, MLflow)."""
