"""The pickling rule, end to end: a run on S3 (s3fs against a moto server on loopback) with
credentials in ``storage_options``; its ``last_run``, the same run opened by
``RunResult.from_path`` and ``list_runs``, and every checkpoint in them hold no credential in
a pickle, a cloudpickle, a ``copy``/``deepcopy``, ``dataclasses.asdict`` or ``vars()``, nor in
any object reachable from them. Local and distributed mode (``local[2]``). The unpickled
result's checkpoint opens in this process while the run's own result lives; once that is gone,
and in another process, it asks for the options (naming them) before touching the storage, and
opens when they are given again, as an argument or in ``SPARK_TORCH_STORAGE_OPTIONS``."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import pickle
import subprocess
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from spark_torch import ConfigurationError, Distributor, RunResult, list_runs
from spark_torch.base import envnames

from .report_programs import report_scores
from .test_storage_s3 import s3  # noqa: F401 - the moto server fixture

#: recognisable, and in no other test
SECRET = "pickled-secret-" + uuid.uuid4().hex
#: what a walk of the reachable objects does not enter: code, classes and modules hold no run's state
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType)


def _options(server: dict[str, Any]) -> dict[str, Any]:
    return {**server["options"], "secret": SECRET}


def _reachable_secrets(root: Any) -> list[str]:
    """The type names of the objects reachable from ``root`` that hold the secret."""
    import gc as collector

    seen: set[int] = set()
    stack, found = [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        if isinstance(obj, (str, bytes)):
            if SECRET in (obj if isinstance(obj, str) else obj.decode("latin-1")):
                found.append(type(obj).__name__)
            continue
        stack.extend(collector.get_referents(obj))
    return found


def _given_away(obj: Any) -> dict[str, bytes]:
    """Every form of ``obj`` a user may store or ship, by name."""
    forms = {
        "pickle": pickle.dumps(obj),
        "cloudpickle": cloudpickle.dumps(obj),
        "copy": pickle.dumps(copy.copy(obj)),
        "deepcopy": pickle.dumps(copy.deepcopy(obj)),
        "vars": pickle.dumps(vars(obj)) + repr(vars(obj)).encode(),
        "repr": repr(obj).encode(),
    }
    if dataclasses.is_dataclass(obj):
        forms["asdict"] = pickle.dumps(dataclasses.asdict(obj)) + repr(dataclasses.asdict(obj)).encode()
    return forms


def _leaks(obj: Any) -> list[str]:
    leaked = [form for form, data in _given_away(obj).items() if SECRET.encode() in data]
    return leaked + [f"reachable {name}" for name in _reachable_secrets(obj)]


def _check_no_credential_anywhere(result: RunResult, options: dict[str, Any]) -> None:
    assert result.checkpoint is not None and len(result.best_checkpoints) == 3
    things: dict[str, Any] = {"result": result, "checkpoint": result.checkpoint}
    things.update({f"best {i}": c for i, (c, _) in enumerate(result.best_checkpoints)})
    things.update({f"attempt {i}": a for i, a in enumerate(result.attempts)})
    past = RunResult.from_path(result.path or "", storage_options=options)
    things.update({"from_path": past, "from_path checkpoint": past.checkpoint})
    (summary,) = [s for s in list_runs("s3://runs/pickles", storage_options=options) if s.run_id == result.run_id]
    things.update({"list_runs": summary, "list_runs checkpoint": summary.best_checkpoint})
    leaks = {name: found for name, thing in things.items() if (found := _leaks(thing))}
    assert leaks == {}


def _opens(checkpoint: Any, target: Path, **kwargs: Any) -> bool:
    return (Path(checkpoint.to_directory(target, **kwargs)) / "score.txt").read_text() == "0.9"


def _check_live(result: RunResult, dump: bytes, tmp_path: Path, options: dict[str, Any]) -> None:
    """In this process, while the run's result lives, a copy or a pickle of it opens as it does;
    in another process the pickle asks for the options, and opens with them in the environment."""
    assert _opens(pickle.loads(dump).checkpoint, tmp_path / "live-pickle")
    assert _opens(copy.deepcopy(result).checkpoint, tmp_path / "live-deepcopy")
    assert _opens(cloudpickle.loads(cloudpickle.dumps(result)).best_checkpoints[0][0], tmp_path / "live-cloudpickle")
    (tmp_path / "result.pkl").write_bytes(dump)
    env = {k: v for k, v in os.environ.items() if k != envnames.STORAGE_OPTIONS}
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9")  # options that do not arrive must not send the test to AWS
    done = subprocess.run(
        [sys.executable, "-c", _ANOTHER_PROCESS, str(tmp_path), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    asked, given = done.stdout.strip().splitlines()[-2:]
    assert asked.startswith("ConfigurationError checkpoint.to_directory(): s3://runs/pickles/"), asked
    assert (
        "pass them again: checkpoint.to_directory(storage_options={'client_kwargs': ..., 'key': ..., 'secret': ...})"
        in asked
    )
    assert given == "0.9" and not (tmp_path / "other").exists()


def _check_orphan(dump: bytes, tmp_path: Path, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process once the run's result is gone: asked for, then given again."""
    gc.collect()
    orphan = pickle.loads(dump)
    with pytest.raises(
        ConfigurationError, match=r"storage_options=\{'client_kwargs': \.\.\., 'key': \.\.\., 'secret': \.\.\.\}"
    ):
        orphan.checkpoint.to_directory(tmp_path / "orphan")
    assert not (tmp_path / "orphan").exists()
    assert _opens(orphan.checkpoint, tmp_path / "given", storage_options=options)
    with orphan.best_checkpoints[-1][0].as_directory(storage_options=options) as directory:
        assert os.listdir(directory)
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, json.dumps(options))
    assert _opens(orphan.checkpoint, tmp_path / "from-env")


_ANOTHER_PROCESS = """
import json, os, pickle, sys
from pathlib import Path
from spark_torch import ConfigurationError
result = pickle.loads((Path(sys.argv[1]) / "result.pkl").read_bytes())
try:
    result.checkpoint.to_directory(Path(sys.argv[1]) / "other")
    print("opened without options")
except ConfigurationError as exc:
    print(type(exc).__name__, str(exc).replace(chr(10), " "))
os.environ["SPARK_TORCH_STORAGE_OPTIONS"] = sys.argv[2]
print((Path(result.checkpoint.to_directory(Path(sys.argv[1]) / "env")) / "score.txt").read_text())
"""


def _run_and_check(server: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **mode: Any) -> None:
    """A run with the secret in its storage options (``mode``: the Distributor's mode arguments),
    then every check of the pickling rule on its result."""
    monkeypatch.delenv(envnames.STORAGE_OPTIONS, raising=False)
    monkeypatch.setenv(
        "AWS_ENDPOINT_URL", "http://127.0.0.1:9"
    )  # options that do not arrive must not send the test to AWS
    options = _options(server)
    d = Distributor(
        num_processes=2,
        storage_path="s3://runs/pickles",
        storage_options=options,
        checkpoint_score_attribute="score",
        **mode,
    )
    d.run(report_scores, [0.5, 0.7, 0.9])
    assert d.last_run is not None
    _check_no_credential_anywhere(d.last_run, options)
    dump = pickle.dumps(d.last_run)
    _check_live(d.last_run, dump, tmp_path, options)
    del d  # the run's result with it
    _check_orphan(dump, tmp_path, options, monkeypatch)


def test_a_local_runs_result_holds_no_credential(
    s3: dict[str, Any],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_leftovers: None,
) -> None:
    _run_and_check(s3, tmp_path, monkeypatch)


def test_a_distributed_runs_result_holds_no_credential(
    s3: dict[str, Any],  # noqa: F811 - the fixture imported above
    spark_session: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_leftovers: None,
) -> None:
    _run_and_check(s3, tmp_path, monkeypatch, local_mode=False, spark=spark_session)
