"""Driver side: where the persisted ``report()`` rows of one ``run()`` go.

Every row goes to the call's record (``RunResult.rows`` in the end), to the live status line (the latest metrics), to
a live
chart in Jupyter (the numeric metrics against ``step``, redrawn at most once a second, left in
the cell as a static image at the end; matplotlib, skipped without it), and to MLflow when
asked (one MLflow run per ``run()``, restarts included).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.console.logs import DriverLogSink
from spark_torch.driver.console.status import in_jupyter
from spark_torch.driver.run_record import RunRecord
from spark_torch.errors import ConfigurationError
from spark_torch.reporting.api import RECORDED_KEYS
from spark_torch.reporting.checkpoint import Checkpoint
from spark_torch.shared.spec import LaunchPlan

__all__ = ["ReportTracker", "numeric_metrics", "chart_figure"]

logger = logging.getLogger(__name__)

#: the chart is redrawn at most this often
CHART_SECONDS = 1.0


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a row (not what spark_torch records with it, not booleans or text)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in RECORDED_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def chart_figure(rows: list[dict[str, Any]]) -> Any:
    """One panel per numeric metric against ``step`` (integer ticks: steps are counted), on a
    :class:`~matplotlib.figure.Figure` with its own Agg canvas; None when no row has a metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = sorted({k for row in rows for k in numeric_metrics(row)})
    if not keys:
        return None
    fig = Figure(figsize=(min(4 * len(keys), 16), 3))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(keys), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(row["step"], numeric_metrics(row)[key]) for row in rows if key in numeric_metrics(row)]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    return fig


class _Chart:
    """A matplotlib chart in the Jupyter cell, updated in place.

    Drawn on a :class:`~matplotlib.figure.Figure` with its own Agg canvas, never through
    pyplot: the user's backend and pyplot's figures stay as they were (a later ``plt.show()``
    still draws).
    """

    def __init__(self) -> None:
        import matplotlib.figure  # noqa: F401 - without matplotlib there is no chart (ImportError)
        from IPython.display import display

        self._display = display
        self._handle: Any = None
        self._drawn = 0.0

    def draw(self, rows: list[dict[str, Any]], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < CHART_SECONDS:
            return
        self._drawn = now
        import io

        from IPython.display import Image

        fig = chart_figure(rows)
        if fig is None:
            return
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=80)
        image = Image(data=buffer.getvalue(), format="png")
        if self._handle is None:
            self._handle = self._display(image, display_id=True)
        else:
            self._handle.update(image)


class _MlflowLog:
    """Logs rows into one MLflow run (the active one, or one started for this run())."""

    def __init__(self, config: DistributorConfig, plan: LaunchPlan, run_id: str) -> None:
        import mlflow

        self._mlflow = mlflow
        active = mlflow.active_run()
        self._started = active is None
        run = active or mlflow.start_run(run_name=f"spark_torch-{run_id}")
        self.run_id = run.info.run_id
        self._client = mlflow.tracking.MlflowClient()
        params = {
            "spark_torch.run_id": run_id,
            "spark_torch.num_processes": config.num_processes,
            "spark_torch.local_mode": config.local_mode,
            "spark_torch.world_size": plan.world_size,
            "spark_torch.use_gpu": plan.use_gpu,
            "spark_torch.max_restarts": config.max_restarts,
        }
        try:
            mlflow.log_params(params)
        except Exception as exc:  # noqa: BLE001 - e.g. the same keys logged by an earlier run() in this MLflow run
            logger.info("spark_torch: MLflow parameters not logged again (%s)", exc)

    def row(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(row["time"] * 1000)
        metrics = [Metric(key, value, stamp, int(row["step"])) for key, value in numeric_metrics(row).items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, checkpoint: str | None, error: BaseException | None) -> None:
        if checkpoint is not None:
            self._client.set_tag(self.run_id, "spark_torch.checkpoint", checkpoint)
        if self._started:
            self._mlflow.end_run(status="FAILED" if error is not None else "FINISHED")


def _mlflow_for(config: DistributorConfig, plan: LaunchPlan, run_id: str) -> _MlflowLog | None:
    if config.mlflow is False:
        return None
    if config.mlflow is None and "mlflow" not in sys.modules:
        return None  # no active MLflow run without mlflow imported (importing it costs seconds and warnings)
    try:
        import mlflow
    except ImportError:
        if config.mlflow:
            raise ConfigurationError(
                "mlflow=True but MLflow is not installed: pip install mlflow (or mlflow-skinny)"
            ) from None
        return None
    if config.mlflow is None and mlflow.active_run() is None:
        return None
    return _MlflowLog(config, plan, run_id)


class ReportTracker:
    """Receives the persisted rows of one run() (from coordinator threads)."""

    def __init__(
        self, record: RunRecord, sink: DriverLogSink, config: DistributorConfig, plan: LaunchPlan, run_id: str
    ) -> None:
        self._record = record
        self._sink = sink
        self._mlflow = _mlflow_for(config, plan, run_id)
        self._chart: _Chart | None = None
        show = config.progress is not False and in_jupyter()
        if show:
            try:
                self._chart = _Chart()
            except ImportError:  # no matplotlib / IPython: the status line shows the metrics
                self._chart = None

    def resume_from(self, step: int) -> None:
        """An attempt starts from the checkpoint of ``step``: later rows will be reported again."""
        self._record.resume_from(step)

    def row(self, row: dict[str, Any]) -> None:
        """A persisted report() step."""
        rows = self._record.add_row(row)
        self._sink.status.metrics(row)
        if self._chart is not None:
            try:
                self._chart.draw(rows)
            except Exception as exc:  # noqa: BLE001 - a chart must never break a run
                logger.warning("spark_torch: live chart disabled (%s)", exc)
                self._chart = None
        if self._mlflow is not None:
            try:
                self._mlflow.row(row)
            except Exception as exc:  # noqa: BLE001 - nor must MLflow
                logger.warning("spark_torch: could not log step %s to MLflow (%s)", row.get("step"), exc)

    def close(self, checkpoint: Checkpoint | None, error: BaseException | None) -> None:
        """The run ended (its latest ``checkpoint``, its ``error``): the final chart stays in the
        cell; the MLflow run is ended if ours."""
        rows = list(self._record.rows)
        if self._chart is not None and rows:
            try:
                self._chart.draw(rows, force=True)
            except Exception:  # noqa: BLE001 - see row()
                pass
        if self._mlflow is not None:
            try:
                self._mlflow.close(checkpoint.path if checkpoint is not None else None, error)
            except Exception as exc:  # noqa: BLE001
                logger.warning("spark_torch: could not finish the MLflow run (%s)", exc)
