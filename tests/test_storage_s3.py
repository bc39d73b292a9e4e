"""Checkpoints on object storage, end to end: S3 through s3fs against a moto server on loopback.

Distributed mode on local[2]: the ranks upload their checkpoint files to s3://, the driver
writes manifests and metrics there; a rank is killed mid-run and the gang resumes from the
latest checkpoint in S3; old checkpoints are pruned in S3; last_run.checkpoint is an s3://
Checkpoint that downloads. The credentials reach the ranks in a private file, never in their
environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor, RunResult, list_runs
from spark_torch.driver.config import DistributorConfig

from .conftest import SCRIPTS
from .report_programs import deterministic_ddp

SECRET = "moto-secret-for-tests"
#: the spark-torch command's variable for storage options (docs/cli.md)
STORAGE_OPTIONS = "SPARK_TORCH_STORAGE_OPTIONS"


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
    options = {
        "key": "testing",
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key=SECRET, region_name="us-east-1"
    )
    client.create_bucket(Bucket="runs")
    try:
        yield {"options": options, "client": client}
    finally:
        server.stop()


def environment_has(text: str) -> bool:
    import os

    return any(text in value for value in os.environ.values())


def test_checkpoints_kill_resume_prune_on_s3(
    s3: dict[str, Any], spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    clean = Distributor(num_processes=2, storage_path=tmp_path).run(deterministic_ddp, 8)
    d = Distributor(
        num_processes=2,
        local_mode=False,
        spark=spark_session,
        storage_path="s3://runs/team",
        storage_options=s3["options"],
        max_restarts=1,
        keep_checkpoints=2,
    )
    out = d.run(deterministic_ddp, 8, die_at=5)  # rank 1 SIGKILLs itself in step 5
    result = d.last_run
    assert result is not None and result.restarts == 1 and out["resumed_from"] == 4
    assert all(a.equal(b) for a, b in zip(clean["weights"], out["weights"]))
    assert result.metrics_dataframe["step"].tolist() == list(range(1, 9))
    assert (
        result.checkpoint is not None and result.checkpoint.path == f"s3://runs/team/{result.run_id}/checkpoint_000008"
    )
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket="runs", Prefix=f"team/{result.run_id}/")["Contents"]]
    checkpoints = sorted({k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint_")})
    assert checkpoints == ["checkpoint_000006", "checkpoint_000008"]  # pruned in S3
    local = result.checkpoint.to_directory(tmp_path / "latest")
    assert sorted(p.name for p in Path(local).iterdir()) == [".spark_torch", "state.pt"]
    again = RunResult.from_path("s3://runs/team", result.run_id, storage_options=s3["options"])
    assert again.checkpoint is not None and again.checkpoint.step == 8 and again.metrics["step"] == 8
    by_dir = RunResult.from_path(f"s3://runs/team/{result.run_id}", storage_options=s3["options"])
    assert by_dir.history == again.history and by_dir.path == f"s3://runs/team/{result.run_id}"
    (listed,) = [r for r in list_runs("s3://runs/team", storage_options=s3["options"]) if r.run_id == result.run_id]
    assert listed.attempts == 2 and listed.world_size == 2 and listed.steps == 8  # the attempt log, appended in S3
    with result.checkpoint.as_directory() as directory:  # downloaded, then removed
        assert sorted(os.listdir(directory)) == [".spark_torch", "state.pt"]
    assert not os.path.exists(directory)
    # the credentials reach the ranks in a 0600 file, not in their environment
    assert (
        Distributor(num_processes=1, storage_path="s3://runs/team", storage_options=s3["options"]).run(
            environment_has, SECRET
        )
        is False
    )


def test_a_storage_error_is_one_error_naming_the_url(s3: dict[str, Any]) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"storage_path='s3://no-such-bucket/x': cannot create the run's directory; the run's storage s3://no-such-bucket/x/\w+ cannot be used",
    ):
        Distributor(storage_path="s3://no-such-bucket/x", storage_options=s3["options"]).run(print)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != STORAGE_OPTIONS}
    # options that do not arrive must not send the test to AWS: a refused loopback port instead
    full.update(
        SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, AWS_ENDPOINT_URL="http://127.0.0.1:9", EPOCHS="1"
    )
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "spark_torch", *args], capture_output=True, text=True, timeout=240, env=full
    )


def test_the_cli_takes_storage_options_from_a_file_or_the_environment(s3: dict[str, Any], tmp_path: Path) -> None:
    """Credentials off the command line: ``--storage-options @FILE`` and SPARK_TORCH_STORAGE_OPTIONS
    both reach the storage (the run's metrics land in S3); a bad text is described, never quoted."""
    options = tmp_path / "options.json"
    options.write_text(json.dumps(s3["options"]))
    script = str(SCRIPTS / "report_script.py")
    by_file = _cli(
        "run", "--storage-path", "s3://runs/cli", "--run-id", "by-file", "--storage-options", f"@{options}", script
    )
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    by_env = _cli(
        "run",
        "--storage-path",
        "s3://runs/cli",
        "--run-id",
        "by-env",
        script,
        env={STORAGE_OPTIONS: json.dumps(s3["options"])},
    )
    assert by_env.returncode == 0, by_env.stderr[-2000:]
    keys = {o["Key"] for o in s3["client"].list_objects_v2(Bucket="runs", Prefix="cli/")["Contents"]}
    assert {"cli/by-file/metrics.jsonl", "cli/by-env/metrics.jsonl"} <= keys, keys
    broken = '{"secret": "' + SECRET + '",}'
    options.write_text(broken)
    for args, env, says in [
        (["--storage-options", broken], None, "--storage-options is not valid JSON (Expecting property name"),
        (["--storage-options", f"@{options}"], None, f"--storage-options: {options} is not valid JSON"),
        (
            ["--storage-options", f"@{tmp_path}/missing.json"],
            None,
            f"--storage-options: cannot read {tmp_path}/missing.json",
        ),
        ([], {STORAGE_OPTIONS: broken}, f"{STORAGE_OPTIONS} is not valid JSON"),
        ([], {STORAGE_OPTIONS: f'["{SECRET}"]'}, f"{STORAGE_OPTIONS} must be a JSON object (got a JSON list)"),
    ]:
        done = _cli("run", "--storage-path", "s3://runs/cli", *args, script, env=env)
        assert done.returncode == 2 and says in done.stderr, (args, env, done.stderr[-2000:])
        assert SECRET not in done.stderr + done.stdout, done.stderr


@pytest.mark.parametrize(
    "quoted",
    [
        {"client_kwargs": {"endpoint_url": f"http://user:{SECRET}@"}},  # botocore: "Invalid endpoint: ..."
        {"config_kwargs": {"signature_version": SECRET}},  # botocore: "Unknown Signature Version: ..."
    ],
)
def test_a_storage_error_never_quotes_the_options(s3: dict[str, Any], quoted: dict[str, Any]) -> None:
    """The backend quotes the option it refused; spark_torch's error (and what it chains) does
    not, nor do the config's repr and its type errors."""
    options = {**s3["options"], **quoted}
    with pytest.raises(
        ConfigurationError, match=r"cannot create the run's directory; the run's storage s3://runs/q/\w+ cannot be used"
    ) as info:
        Distributor(storage_path="s3://runs/q", storage_options=options).run(print)
    chain: list[BaseException] = []
    link: BaseException | None = info.value
    while link is not None:
        chain.append(link)
        link = link.__cause__ or link.__context__
    assert "***" in str(info.value) and not any(SECRET in str(e) for e in chain), [str(e) for e in chain]
    config = DistributorConfig(storage_options=options)
    assert SECRET not in repr(config) and "storage_options" not in repr(config)
    for bad in ({"secret": object()}, [("secret", SECRET)]):
        with pytest.raises(TypeError, match="storage_options") as error:
            DistributorConfig(storage_options=bad)  # type: ignore[arg-type]
        assert SECRET not in str(error.value) and "object at" not in str(error.value)


def saves_a_checkpoint() -> None:
    import os
    import tempfile

    import spark_torch

    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "sub"))
        for name in ("state.pt", os.path.join("sub", "shard.pt")):
            with open(os.path.join(tmp, name), "w") as fh:
                fh.write("x")
        spark_torch.report({"loss": 1.0}, checkpoint=tmp)


def checkpoint_modes() -> dict[str, str]:
    """The modes of the checkpoint this attempt resumed from (its own folder as ``.``)."""
    import os
    import stat

    import spark_torch

    root = spark_torch.get_checkpoint()
    assert root is not None
    paths = [str(root)] + [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files]
    return {os.path.relpath(p, root): oct(stat.S_IMODE(os.lstat(p).st_mode)) for p in paths}


def test_a_checkpoint_downloaded_into_the_scratch_folder_is_private(s3: dict[str, Any], no_leftovers: None) -> None:
    """Under umask 0 (an executor's, often), fsspec's copy would be 0666: the node narrows it to
    files 0600 and folders 0700 before any rank reads it."""
    storage = {"storage_path": "s3://runs/modes", "storage_options": s3["options"]}
    first = Distributor(num_processes=1, **storage)
    first.run(saves_a_checkpoint)
    assert first.last_run is not None
    old = os.umask(0)
    try:
        modes = Distributor(num_processes=1, run_id=first.last_run.run_id, **storage).run(checkpoint_modes)
    finally:
        os.umask(old)
    assert modes.pop(".") == "0o700" and modes.pop("sub") == "0o700"
    assert "state.pt" in modes and os.path.join("sub", "shard.pt") in modes
    assert set(modes.values()) == {"0o600"}, modes
