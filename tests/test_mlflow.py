"""MLflow: one MLflow run per run() (restarts included), metrics with their step, the run's
parameters; against real MLflow with a local file store."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor

from .report_programs import deterministic_ddp, report_steps

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def tracking(tmp_path: Path) -> Any:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 keeps the file store for tests like this
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")
    yield mlflow.tracking.MlflowClient()
    if mlflow.active_run() is not None:
        mlflow.end_run()


def test_logs_into_the_active_run_across_a_restart(tracking: Any, tmp_path: Path, no_leftovers: None) -> None:
    with mlflow.start_run() as active:
        d = Distributor(num_processes=2, storage_path=tmp_path / "store", max_restarts=1)
        d.run(deterministic_ddp, 8, 3, die_at=5)
    assert d.last_run is not None and d.last_run.restarts == 1
    runs = tracking.search_runs([active.info.experiment_id])
    assert [r.info.run_id for r in runs] == [active.info.run_id]  # one MLflow run, restart included
    history = tracking.get_metric_history(active.info.run_id, "loss")
    final = {}
    for point in sorted(history, key=lambda m: m.timestamp):
        final[point.step] = point.value  # a step re-reported after the restart: the later value
    assert sorted(final) == list(range(1, 9))
    assert final == {int(r["step"]): pytest.approx(r["loss"]) for r in d.last_run.rows}
    params = tracking.get_run(active.info.run_id).data.params
    assert params["spark_torch.num_processes"] == "2" and params["spark_torch.run_id"] == d.last_run.run_id
    assert tracking.get_run(active.info.run_id).data.tags["spark_torch.checkpoint"] == d.last_run.checkpoint.path


def test_mlflow_true_starts_and_ends_a_run(tracking: Any, tmp_path: Path, no_leftovers: None) -> None:
    d = Distributor(num_processes=1, storage_path=tmp_path / "store", mlflow=True)
    d.run(report_steps, 3)
    assert mlflow.active_run() is None
    (run,) = tracking.search_runs([tracking.get_experiment_by_name("Default").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == f"spark_torch-{d.last_run.run_id}"  # type: ignore[union-attr]
    assert [m.step for m in tracking.get_metric_history(run.info.run_id, "i")] == [1, 2, 3]
    params = tracking.get_run(run.info.run_id).data.params
    assert params["spark_torch.local_mode"] == "True" and params["spark_torch.world_size"] == "1"
    assert sorted(params) == sorted(_documented_parameters())


def _documented_parameters() -> list[str]:
    """The MLflow parameters docs/checkpoints.md names."""
    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md").read_text().split())
    sentence = page[page.index("the parameters (") :].split("), and")[0]
    return re.findall(r"`(spark_torch\.\w+)`", sentence)


def test_mlflow_none_without_active_run_logs_nothing(tracking: Any, tmp_path: Path, no_leftovers: None) -> None:
    Distributor(num_processes=1, storage_path=tmp_path / "store").run(report_steps, 2)
    experiment = tracking.get_experiment_by_name("Default")
    assert experiment is None or not tracking.search_runs([experiment.experiment_id])
