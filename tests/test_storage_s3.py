"""Checkpoints on object storage, end to end: S3 through s3fs against a moto server on loopback.

Distributed mode on local[2]: the ranks upload their checkpoint files to s3://, the driver
writes manifests and metrics there; a rank is killed mid-run and the gang resumes from the
latest checkpoint in S3; old checkpoints are pruned in S3; last_run.checkpoint is an s3://
Checkpoint that downloads. The credentials reach the ranks in a private file, never in their
environment.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor, load_run

from .report_programs import deterministic_ddp

SECRET = "moto-secret-for-tests"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 with one bucket; yields the fsspec storage options."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"key": "testing", "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key=SECRET, region_name="us-east-1")
    client.create_bucket(Bucket="runs")
    try:
        yield {"options": options, "client": client}
    finally:
        server.stop()


def environment_has(text: str) -> bool:
    import os

    return any(text in value for value in os.environ.values())


def test_checkpoints_kill_resume_prune_on_s3(s3: dict[str, Any], spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    clean = Distributor(num_processes=2, storage_path=tmp_path).run(deterministic_ddp, 8)
    d = Distributor(
        num_processes=2, local_mode=False, spark=spark_session, storage_path="s3://runs/team",
        storage_options=s3["options"], max_restarts=1, keep_checkpoints=2,
    )  # fmt: skip
    out = d.run(deterministic_ddp, 8, die_at=5)  # rank 1 SIGKILLs itself in step 5
    result = d.last_run
    assert result is not None and result.restarts == 1 and out["resumed_from"] == 4
    assert all(a.equal(b) for a, b in zip(clean["weights"], out["weights"]))
    assert result.metrics_dataframe["step"].tolist() == list(range(1, 9))
    assert result.checkpoint is not None and result.checkpoint.path == f"s3://runs/team/{result.run_id}/checkpoint_000008"
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket="runs", Prefix=f"team/{result.run_id}/")["Contents"]]
    checkpoints = sorted({k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint_")})
    assert checkpoints == ["checkpoint_000006", "checkpoint_000008"]  # pruned in S3
    local = result.checkpoint.to_directory(tmp_path / "latest")
    assert sorted(p.name for p in Path(local).iterdir()) == [".spark_torch", "state.pt"]
    again = load_run("s3://runs/team", result.run_id, storage_options=s3["options"])
    assert again.checkpoint is not None and again.checkpoint.step == 8 and again.metrics["step"] == 8
    # the credentials reach the ranks in a 0600 file, not in their environment
    assert Distributor(num_processes=1, storage_path="s3://runs/team", storage_options=s3["options"]).run(environment_has, SECRET) is False


def test_a_storage_error_is_one_error_naming_the_url(s3: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=r"storage_path='s3://no-such-bucket/x': cannot create the run's directory; the run's storage s3://no-such-bucket/x/\w+ cannot be used"):
        Distributor(storage_path="s3://no-such-bucket/x", storage_options=s3["options"]).run(print)
